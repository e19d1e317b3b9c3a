"""Keep measured-timing caches out of the user's home: every test session gets its own."""

import os
import tempfile

os.environ.setdefault("AUTOPLAN_CACHE", tempfile.mkdtemp(prefix="autoplan-test-cache-"))
