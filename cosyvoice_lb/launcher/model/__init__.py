"""The model dir: what `prepare-model` makes of a read-only one for --load-vllm and --load-trt."""
