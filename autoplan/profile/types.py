"""Moved to autoplan.profile_data (torch-free core data belongs with the torch-free core); this name stays for
code written against it."""

from autoplan.profile_data import ModelProfile, OpProfile

__all__ = ["ModelProfile", "OpProfile"]
