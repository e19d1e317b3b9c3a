"""Templates of the files codegen writes, kept as real Python modules so a linter checks them and a test
imports them (tests/test_codegen.py). autoplan never imports them: codegen/template.py reads them as text
(train.py imports torch and autoplan.runtime, and would run nothing useful here)."""
