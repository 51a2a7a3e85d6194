"""Integration with vLLM and vllm-ascend, as a vLLM plugin (nothing in vLLM is patched).

plugin.py         the ``vllm.general_plugins`` entry point: registers ``load_format="podsnap"``
loader.py         the model loader: restore from the store, or load as usual and write the snapshot
settings.py       its ``model_loader_extra_config``
identity.py       the fingerprint of a vLLM start, its place in the parallel layout, the snapshot lookup
model_state.py    a vLLM model as podsnap engine state, and a meta-built model filled back from it
derived_state.py  per-platform registry of state outside ``state_dict`` (attributes, globals, derivations)
ascend.py         the vllm-ascend entry (import-guarded; unverified here)
capture.py        writing one snapshot over all ranks
worker.py         the worker extension: snapshot, suspend/resume, group rebuild over ``collective_rpc``
comm.py           rebuilding vLLM's process groups through comm_rebuild
"""
