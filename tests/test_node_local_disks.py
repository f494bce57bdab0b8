"""`save_on_each_node=True` on nodes without a shared disk: every node's own folder holds whole checkpoints (weights,
optimizer, scheduler, every process's RNG file, the trainer and loopkit states), so after a kill of every node each
resumes from its own disk, and the run ends with the uninterrupted run's weights. A kill between two nodes' renames
(one node has the newest checkpoint, another not) resumes every node from the newest they all hold. FSDP and
DeepSpeed on several nodes with save_on_each_node are refused at construction (docs/checkpoints.md)."""

import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from helpers import free_port, output_tail, wait_for
from loopkit.checkpoint import checkpoint_problem

CHILD = os.path.join(os.path.dirname(__file__), "scripts", "node_local_child.py")
# Each process's RNG state and batch read ahead (loopkit_tensors_<rank>) on every node's disk.
CHECKPOINT_FILES = ["loopkit_state.json", "loopkit_tensors_0.safetensors", "loopkit_tensors_1.safetensors",
                    "model.safetensors", "optimizer.pt", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt",
                    "trainer_state.json"]


def launch_two_nodes(out, mode: str) -> tuple[list, list]:
    """Two torchrun "nodes" of one process each on this machine (gloo), each writing under OUT; their exit codes
    and the ends of their outputs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    port, logs = str(free_port()), [out / f"{mode}{node}.log" for node in (0, 1)]
    nodes = [subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nnodes", "2",
                               "--node_rank", str(node), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
                               "--master_port", port, CHILD, str(out), mode], env=env, stderr=subprocess.STDOUT,
                              stdout=open(logs[node], "w")) for node in (0, 1)]
    try:
        for node, process in enumerate(nodes):
            wait_for(process, f"node {node}'s {mode} launch (output in {logs[node]})")
    finally:
        for process in nodes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [process.returncode for process in nodes], [output_tail(log.read_text()) for log in logs]


def test_every_node_resumes_from_its_own_disk_after_a_kill(tmp_path):
    codes, logs = launch_two_nodes(tmp_path, "first")
    assert all(code != 0 for code in codes), logs  # the killed run ends both launches
    for node in (0, 1):
        assert os.path.isfile(tmp_path / f"reference_node{node}" / "final.safetensors"), logs[node]
        folder = tmp_path / f"node{node}"
        assert sorted(p for p in os.listdir(folder) if p.startswith("checkpoint-")) == \
            ["checkpoint-2", "checkpoint-4", "checkpoint-6"], logs[node]
        for step in (2, 4, 6):  # a whole checkpoint on each node's own disk
            assert sorted(os.listdir(folder / f"checkpoint-{step}")) == CHECKPOINT_FILES
            assert checkpoint_problem(str(folder / f"checkpoint-{step}")) is None
    # A kill between the two nodes' renames of checkpoint-6: node 1 never got it. Both resume checkpoint-4.
    os.rename(tmp_path / "node1" / "checkpoint-6", tmp_path / "node1" / ".tmp-checkpoint-6")
    codes, logs = launch_two_nodes(tmp_path, "resume")
    assert codes == [0, 0], logs
    reference = load_file(tmp_path / "reference_node0" / "final.safetensors")
    for folder in ("reference_node1", "node0", "node1"):
        weights = load_file(tmp_path / folder / "final.safetensors")
        assert weights.keys() == reference.keys()
        assert all(torch.equal(weights[k], reference[k]) for k in reference), f"{folder} ended elsewhere"
