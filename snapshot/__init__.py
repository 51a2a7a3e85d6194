"""Snapshot store format, state capture and the snapshot agent (issue: snapshot store)."""
