"""The command line: bridge-fgo-run (launcher), bridge-fgo status (status), and the bootstrap the launcher puts
first on PYTHONPATH."""
