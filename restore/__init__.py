"""Restore path: mmap/parallel loader, on-demand derivation, migration planner (issue: snapshot store)."""
