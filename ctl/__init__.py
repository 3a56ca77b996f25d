"""nvsharectl's command line (main.py); the control-socket client it drives is nvshare_py.control.

Installed, this directory is the package nvshare_py.ctl (pyproject.toml maps it); in a checkout,
`python -m ctl ...` from the repository root runs the same command line.
"""
