"""Lets the tests here import their sibling helper modules (no __init__.py in tests/)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
