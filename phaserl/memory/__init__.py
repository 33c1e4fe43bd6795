"""Memory: what one RL step holds on a rank, and the plan that makes it fit the card.

    budget.py       model shapes in bytes, phase by phase (weights, gradients, AdamW, KV cache, activations)
    activations.py  what one eager layer of phaserl's dense decoder saves for backward, tensor by tensor
    plan.py         the memory plan: checkpointing, the reference streamed, optimizer state on the CPU,
                    micro-batches and the KV budget, chosen cheapest first when the budget does not fit

The run's builder (trainer/speed.py) and the doctor both count with this package; it reads model shapes and
never a config file, a device or a tool.
"""
