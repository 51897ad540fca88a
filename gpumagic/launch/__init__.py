"""Running notebook code elsewhere: the values both sides of a launch share (options, plan, shipping, failures,
replay, replicas, the rendezvous store, seeding) here; ``rank_side`` runs in the ranks, ``kernel_side`` in the
kernel."""
