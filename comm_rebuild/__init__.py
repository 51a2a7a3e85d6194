"""Process-group lifecycle: groups are created, looked up by role and torn
down here, so that no other module keeps a process-group handle across a
rebuild (ARCHITECTURE.md, "Contracts: Communication")."""
