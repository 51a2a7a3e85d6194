"""Integration with vLLM and vllm-ascend as engine hooks (issue: engine hooks)."""
