#!/usr/bin/env bash
# One node's share of a (multi-node) training run: validate the recipe, then torchrun -m latentmill.pipelines.launch.
#
#   deploy/launch.sh CONFIG [key.path=value ...]
#
# `latentmill train CONFIG --nproc N` covers one node (torchrun --standalone); this script is the same
# launch with a rendezvous across nodes. It is what deploy/slurm/train.sbatch (one srun task per node) and
# deploy/k8s/pytorchjob.yaml (one pod per node) run. Environment:
#
#   NPROC_PER_NODE  processes (GPUs) on this node      default: PET_NPROC_PER_NODE, else all visible GPUs, else 1
#   NNODES          nodes in the job                   default: PET_NNODES, else 1
#   NODE_RANK       this node's rank; set -> static rendezvous on MASTER_ADDR:MASTER_PORT (Kubernetes)
#                   default: PET_NODE_RANK; unset -> c10d rendezvous on RDZV_ENDPOINT (SLURM)
#   RDZV_ENDPOINT   host:port of the c10d rendezvous   default: MASTER_ADDR:MASTER_PORT
#   RDZV_ID         job id shared by all nodes          default: latentmill
#   PYTHON          interpreter with latentmill installed   default: .venv/bin/python if present, else python
#
# The recipe's output_dir must be on storage every node sees (the cache is read from it, rank 0 writes
# metrics, checkpoints and the export there). The summary of rank 0 goes to
# $LATENTMILL_LAUNCH_DIR/summary.json (default /tmp/latentmill-launch-$RDZV_ID) on the node of rank 0.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: deploy/launch.sh CONFIG [key.path=value ...]" >&2
    exit 2
fi
CONFIG=$1
shift

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
NPROC_PER_NODE=${NPROC_PER_NODE:-${PET_NPROC_PER_NODE:-}}
if [[ -z "$NPROC_PER_NODE" ]]; then
    gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    NPROC_PER_NODE=$([[ $gpus -gt 0 ]] && echo "$gpus" || echo 1)
fi
NNODES=${NNODES:-${PET_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${PET_NODE_RANK:-}}
RDZV_ID=${RDZV_ID:-latentmill}
WORK=${LATENTMILL_LAUNCH_DIR:-/tmp/latentmill-launch-$RDZV_ID}
mkdir -p "$WORK"

# Validate the recipe (with overrides) before any process starts; every node writes the same JSON.
"$PYTHON" - "$CONFIG" "$WORK/recipe.json" "$@" <<'PY'
import json
import sys

from latentmill.recipe import load_recipe

config, out, *overrides = sys.argv[1:]
recipe = load_recipe(config, overrides)
if recipe.parallel.strategy == "none":
    sys.exit("parallel.strategy is 'none': set parallel.strategy=ddp or fsdp2 for a torchrun launch")
with open(out, "w") as fh:
    json.dump(recipe.to_dict(), fh)
PY

args=(--nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE")
if [[ -n "$NODE_RANK" ]]; then
    args+=(--node-rank="$NODE_RANK" --master-addr="${MASTER_ADDR:?MASTER_ADDR is needed with NODE_RANK}"
           --master-port="${MASTER_PORT:-29500}")
else
    endpoint=${RDZV_ENDPOINT:-${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}}
    args+=(--rdzv-backend=c10d --rdzv-endpoint="$endpoint" --rdzv-id="$RDZV_ID")
fi
# Under the output's training lock (on an object store its training lease; the nodes of one rendezvous share it;
# any other training is refused),
# plan the run's folder (train/runs/<key>, the same on every node) and start torchrun with it appended; nothing
# runs (exit 0) when this recipe already trained on this snapshot.
rendezvous=""
if [[ $NNODES -gt 1 ]]; then
    rendezvous=$([[ -n "$NODE_RANK" ]] && echo "$MASTER_ADDR:${MASTER_PORT:-29500}" || echo "$endpoint")/$RDZV_ID
fi
exec "$PYTHON" -m latentmill.pipelines.runs "$WORK/recipe.json" $((NNODES * NPROC_PER_NODE)) "$rendezvous" -- \
    "$PYTHON" -m torch.distributed.run "${args[@]}" -m latentmill.pipelines.launch "$WORK/recipe.json" "$WORK/summary.json"
