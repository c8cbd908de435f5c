"""The figures of a run through `splitserve serve`, shared by the benchmarks that run one."""


def figures(before, after, done) -> dict:
    """From GetLoad before and after the run and the run's Completions: steps, output tokens,
    stream messages per token, link bytes and control-plane CPU (engine process and gRPC
    front-end) per step. Fails when a token counted in usage never reached the client."""
    steps = after.num_steps - before.num_steps
    tokens = sum(c.completion_tokens for c in done)
    lost = tokens - sum(len(c.token_ids) for c in done)
    assert lost == 0, f"{lost} tokens counted in usage never reached the client"
    per_step = lambda field: (getattr(after, field) - getattr(before, field)) / steps  # noqa: E731
    return {"num_steps": steps, "output_tokens": tokens,
            "stream_messages_per_token": sum(c.num_chunks for c in done) / tokens,
            "bytes_per_step_sent": per_step("link_bytes_sent"),
            "bytes_per_step_received": per_step("link_bytes_received"),
            "control_plane_cpu_ms_per_step": 1e3 * per_step("control_plane_cpu_seconds"),
            "frontend_cpu_ms_per_step": 1e3 * per_step("frontend_cpu_seconds")}
