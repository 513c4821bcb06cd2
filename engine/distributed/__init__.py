"""Replica groups: k ranks serve one model with its weights split k ways (tensor parallel)."""
