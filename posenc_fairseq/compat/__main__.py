"""`python -m posenc_fairseq.compat`: the fixes that importing the plugin applied here, and why."""
from . import report

print(report())
