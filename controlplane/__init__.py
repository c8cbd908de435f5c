"""The control plane: every decision, integers only. gRPC API, validation, tokenizer, scheduler,
paged-KV block manager, prefix cache. Never imports torch; never touches a tensor."""
