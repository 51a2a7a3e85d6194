"""podsnap: checkpoint/restore for LLM inference pods on accelerators.

The front door: the CLI lives in ``podsnap.cli``; the types every part shares
(engine state contract, errors) live beside it. The parts are sub-packages:
``podsnap.engine``, ``podsnap.snapshot``, ``podsnap.restore``,
``podsnap.comm_rebuild``, ``podsnap.criu_plugin``, ``podsnap.engine_hooks``.
"""

__version__ = "0.1.0"
