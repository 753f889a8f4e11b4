"""Monitoring: metrics, detectors, FLOPs, the HTML report.

Import the modules themselves (``from peergrade.monitoring import ...``); this file imports nothing."""
