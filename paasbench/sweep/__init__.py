"""`paasbench sweep`: find the highest load that meets the SLO (see docs/sweep.md)."""
