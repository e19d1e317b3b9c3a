"""autoplan verify's harness: train.py's one hook (hooks.py: nothing unless verify launched the run) and the
single-device reference run (reference.py: python -m autoplan.runtime.harness.reference). Builds on distributed/
and components/; nothing in them imports it."""
