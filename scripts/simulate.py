#!/usr/bin/env python3
"""Replay a synthetic workload through the scheduler in virtual time (same as `ninfer simulate`)."""

import sys

from ninfer.cli.simulate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
