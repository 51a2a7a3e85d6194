"""CRIU plugin shim, device-hook server and device backends (issue: CRIU plugin)."""
