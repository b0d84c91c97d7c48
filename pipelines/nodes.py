"""``node_check_job``: the health check of one SLURM node from the Dagster UI (resources/node_health.py).

Launch it with ``{"ops": {"node_check": {"config": {"node": "node2"}}}}``. The run succeeds when
every part of the check passes its floor (the node is in service), and fails, naming the failed
parts, when one does not (the node is drained); either way the result joins the node's history,
which ``trainyard nodes`` lists.
"""

import dagster as dg


class NodeCheckConfig(dg.Config):
    node: str
    """The SLURM node to check (a drained one returns to service only if the check passes)."""
    peer: str = ""
    """A healthy node for the collective; empty: one in the node's partition."""
    floors: dict[str, float] = {}
    """Overrides of the floors (compute_gflops, memory_gbps, disk_write_mbps, allreduce_gbps)."""


@dg.op(name="node_check")
def node_check_op(context: dg.OpExecutionContext, config: NodeCheckConfig) -> None:
    from resources.node_health import NodeCheckError, check_node

    try:
        result = check_node(config.node, peer=config.peer, floors=config.floors)
    except NodeCheckError as error:
        raise dg.Failure(description=f"node check of {config.node} could not run: {error}", allow_retries=False) from error
    metadata = {**{f"figure/{name}": value for name, value in result.figures.items()},
                **{f"floor/{name}": value for name, value in result.floors.items()},
                "peer": result.peer, "state_after": result.state_after, "passed": result.passed}
    context.log_event(dg.AssetObservation(asset_key=dg.AssetKey(["slurm_nodes", config.node]), metadata=metadata))
    if not result.passed:
        raise dg.Failure(description=f"{config.node} failed its check and is drained: " +
                         "; ".join(f"{name} {why}" for name, why in result.failed.items()),
                         metadata={"failed": ", ".join(result.failed)}, allow_retries=False)
    context.log.info(f"{config.node} passed every part of its check and is in service (peer {result.peer})")


@dg.job(name="node_check_job", description="Check one SLURM node (compute, memory, disk, a collective with a peer); "
                                            "it returns to service only if every part passes.")
def node_check_job() -> None:
    node_check_op()
