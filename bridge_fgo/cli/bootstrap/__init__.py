"""The directory bridge-fgo-run puts first on PYTHONPATH. Python's `site` imports the
sitecustomize.py in it at the start of every process the launched command starts.

Importing this package does nothing; the launcher only asks it where it lives.
"""
import os

DIRECTORY = os.path.dirname(os.path.abspath(__file__))
