"""Lets the tests here import their sibling helper modules (no __init__.py in tests/), and the fake API server's
admission (tests/operator/fake_admission.py: the CRD's CEL rules as the API server runs them)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).parents[1] / "operator"))
