"""Importing it installs support/te_free.py's finder: the first module a rank's fork server preloads
(test_agree.run_ranks_with), so that Bridge's modules after it load without Transformer Engine."""
from support import te_free

te_free.install()
