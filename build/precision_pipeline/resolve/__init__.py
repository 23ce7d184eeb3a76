"""Resolve and check: derivations, the memory plan and the named rules that refuse a profile early (torch-free)."""
