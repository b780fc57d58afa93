"""What every Ray benchmark sets before torch and Ray are imported: quiet transformers, torch threads that sleep
instead of spinning when they wait (two torch processes on two cores: ENVIRONMENT-NOTES), a throw-away local Ray
cluster on loopback, and the repository on sys.path."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(ROOT))
