"""One writer per output_dir: the writer lock that prep, gc and compaction hold, with real processes.

Two ``latentmill prep`` processes started together on one output_dir; a prep with ``prep.on_busy=fail``
while a gc holds the lock; a prep killed with SIGKILL while it holds the lock, then the next writer. The
training lock of the same kind: a second training refused, a multi-node training's nodes joining it. Output
of every child goes to a file, never to an unread pipe.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from latentmill.pipelines.flows import Launch, run_train
from latentmill.pipelines.retention import (
    LOCK_FILE,
    TRAIN_LOCK,
    OutputBusyError,
    published,
    training_lock,
    writer_lock,
)
from latentmill.pipelines.snapshot import latest_name

from latentmill.inspect import verify_path
from latentmill.recipe import load_recipe
from tests.conftest import DEMO_CONFIG, REPO_ROOT
from tests.test_retention import IMAGES, _fill, _recipe, _wait_for

pytestmark = pytest.mark.slow


_HOLD_LOCK = """
import sys, time
from latentmill.pipelines.retention import writer_lock
with writer_lock(sys.argv[1], "prep"):
    print("held", flush=True)
    time.sleep(3600)
"""


def test_writer_lock_fails_naming_the_holder_and_a_killed_holder_never_blocks(tmp_path, capsys):
    out = tmp_path / "out"
    log = tmp_path / "hold.log"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(out)], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        _wait_for(log, "held", proc)
        with pytest.raises(OutputBusyError, match=f"a prep is writing it \\(PID {proc.pid} on "):
            with writer_lock(out, "gc", on_busy="fail"):
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    with writer_lock(out, "gc", on_busy="fail"):
        assert "gc since" in (out / LOCK_FILE).read_text()
    assert f"gc: taking over the writer lock of {out} left by PID {proc.pid} on" in capsys.readouterr().out
    assert (out / LOCK_FILE).read_text() == ""  # released cleanly: the next one takes it without a word
    with writer_lock(out, "prep"):
        pass
    assert "taking over" not in capsys.readouterr().out


def _prep_process(out: Path, tiny_flux: Path, source: Path, log: Path, *overrides: str):
    # the session's Prefect API (tests/conftest.py): the lock is the subject here, not the temporary server
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "-m", "latentmill.cli", "prep", str(DEMO_CONFIG), f"output_dir={out}",
           f"model.pretrained={tiny_flux}", f"ingest.source={source}", *overrides]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                            start_new_session=True)


@pytest.mark.heavy  # make test: a second prep refused naming the writer, and a killed holder, below
def test_two_preps_started_together_end_with_one_verified_snapshot(tiny_flux, tmp_path):
    out, source = tmp_path / "out", tmp_path / "images"
    _fill(source, IMAGES[:8])
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [_prep_process(out, tiny_flux, source, log) for log in logs]
    codes = [p.wait(timeout=400) for p in procs]
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], texts
    assert sum("prep: waiting for another prep writing to" in t for t in texts) == 1  # one queued behind
    assert len(published(out)) == 1
    assert all(f"snapshot: {latest_name(out)}" in t for t in texts)
    assert verify_path(out) == 0 and verify_path(out / "snapshots" / latest_name(out)) == 0


def test_prep_on_busy_fail_names_the_running_writer(tiny_flux, tmp_path):
    """This process holds the lock as a gc (the lock is the kernel's, per open file): the prep fails at once."""
    out, source = tmp_path / "out", tmp_path / "images"
    _fill(source, IMAGES[:2])
    with writer_lock(out, "gc"):
        log = tmp_path / "prep.log"
        prep = _prep_process(out, tiny_flux, source, log, "prep.on_busy=fail")
        assert prep.wait(timeout=300) == 1
    errors = [line for line in log.read_text().splitlines() if line.startswith("latentmill: error:")]
    assert len(errors) == 1 and f"a gc is writing it (PID {os.getpid()} on " in errors[0], log.read_text()


def test_a_prep_killed_while_it_holds_the_lock_never_blocks_the_next(tiny_flux, tmp_path, capsys):
    from latentmill.pipelines.prep import run_stages_in_process
    from latentmill.pipelines.snapshot import publish

    out, source = tmp_path / "out", tmp_path / "images"
    _fill(source, IMAGES[:8])
    first = _prep_process(out, tiny_flux, source, tmp_path / "first.log")
    deadline = time.monotonic() + 300
    while f"PID {first.pid} " not in ((out / LOCK_FILE).read_text() if (out / LOCK_FILE).is_file() else ""):
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)  # the prep and any process it started
    first.wait(timeout=30)
    recipe = _recipe(out, source, tiny_flux)
    with writer_lock(out, "prep", on_busy="fail"):  # not busy: the kernel dropped the dead prep's lock
        run_stages_in_process(recipe)
        name = publish(out, recipe.stage_dir("cache"))["name"]
    assert f"prep: taking over the writer lock of {out} left by PID {first.pid} on" in capsys.readouterr().out
    assert published(out) == [name] and verify_path(out) == 0


_HOLD_TRAINING = """
import sys, time
from latentmill.pipelines.retention import training_lock
with training_lock(sys.argv[1], sys.argv[2] or None):
    print("training", flush=True)
    time.sleep(3600)
"""


def _hold_training(out: Path, log: Path, rendezvous: str = "") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_TRAINING, str(out), rendezvous], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    _wait_for(log, "training", proc)
    return proc


def test_a_second_training_of_a_local_output_is_refused_until_the_first_dies(tmp_path, capsys):
    """Two trainings would prune, set aside and overwrite each other's checkpoints and ``train/LATEST``: while
    one holds the training lock (a process, SIGKILLed later), a second is refused in one line naming it, before
    it chooses a run folder; so is a node of a multi-node training; once the holder died, the next goes on."""
    out = tmp_path / "out"
    out.mkdir()
    recipe = load_recipe(DEMO_CONFIG, [f"output_dir={out}"])
    proc = _hold_training(out, tmp_path / "holder.log")
    try:
        with pytest.raises(OutputBusyError) as refused:
            run_train(recipe)
        line = (out / TRAIN_LOCK).read_text().strip()
        assert str(refused.value) == (f"{out} is busy: a training is writing it ({line}; lock {out / TRAIN_LOCK}). "
                                      "Wait for it to finish, or train into another output_dir")
        assert line.startswith(f"PID {proc.pid} on ") and ": training since " in line
        assert not (out / "train").exists()  # refused before a run folder was chosen
        multi = load_recipe(DEMO_CONFIG, [f"output_dir={out}", "parallel.strategy=ddp"])
        with pytest.raises(OutputBusyError, match=f"a training is writing it \\(PID {proc.pid} on "):
            run_train(multi, Launch(nproc=1, nnodes=2, rdzv_endpoint="node1:29500"))
    finally:
        proc.kill()
        proc.wait(timeout=30)
    capsys.readouterr()
    with pytest.raises(FileNotFoundError, match="no snapshot published"):  # past the lock, to the missing prep
        run_train(recipe)
    assert f"training: taking over the training lock of {out} left by PID {proc.pid} on " in capsys.readouterr().out
    assert (out / TRAIN_LOCK).read_text() == ""  # released when that training ended


def test_the_nodes_of_one_multi_node_training_share_its_lock_and_other_trainings_are_refused(tmp_path, capsys):
    """Every node runs the same command on a shared file system: the first to start holds the lock, naming the
    rendezvous; a node with the same rendezvous joins it, a training with another rendezvous or on one node is
    refused."""
    out = tmp_path / "out"
    out.mkdir()
    recipe = load_recipe(DEMO_CONFIG, [f"output_dir={out}", "parallel.strategy=ddp"])
    node = Launch(nproc=1, nnodes=2, rdzv_endpoint="node1:29500")
    proc = _hold_training(out, tmp_path / "node1.log", node.rendezvous)
    try:
        line = (out / TRAIN_LOCK).read_text().strip()
        assert line.startswith(f"PID {proc.pid} on ") and ": training of rendezvous node1:29500/latentmill since " in line
        capsys.readouterr()
        with pytest.raises(FileNotFoundError, match="no snapshot published"):  # joined: on to the missing prep
            run_train(recipe, node)
        assert capsys.readouterr().out == (f"training of rendezvous node1:29500/latentmill: joining the training lock "
                                           f"of {out} that this run's first node holds ({line})\n")
        for other in (Launch(nproc=1, nnodes=2, rdzv_endpoint="node7:29500"), Launch(nproc=2)):
            with pytest.raises(OutputBusyError, match=f"a training is writing it \\(PID {proc.pid} on "):
                run_train(recipe, other)
        assert (out / TRAIN_LOCK).read_text().strip() == line  # a node that joined leaves the holder's line
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_cluster_launch_takes_the_training_lock_of_its_output(tmp_path, capsys):
    """``deploy/launch.sh``'s node step (``python -m latentmill.pipelines.runs``) holds the lock as ``latentmill
    train`` does: refused in one line while another training writes the output, before it plans or starts
    torchrun; a node of the holder's own rendezvous joins it."""
    import json

    from latentmill.pipelines.runs import main as launch_node

    out = tmp_path / "out"
    out.mkdir()
    recipe_json = tmp_path / "recipe.json"
    recipe_json.write_text(json.dumps(load_recipe(DEMO_CONFIG, [f"output_dir={out}", "parallel.strategy=ddp"]).to_dict()))
    ran = tmp_path / "ran"
    command = ["--", sys.executable, "-c", f"open({str(ran)!r}, 'w')"]
    proc = _hold_training(out, tmp_path / "holder.log", "node1:29500/latentmill")
    try:
        line = (out / TRAIN_LOCK).read_text().strip()
        assert launch_node([str(recipe_json), "2", "", *command]) == 2
        assert capsys.readouterr().err == (f"{out} is busy: a training is writing it ({line}; lock {out / TRAIN_LOCK})."
                                           " Wait for it to finish, or train into another output_dir\n")
        with pytest.raises(FileNotFoundError, match="no snapshot published"):  # joined: on to the missing prep
            launch_node([str(recipe_json), "4", "node1:29500/latentmill", *command])
        assert "joining the training lock" in capsys.readouterr().out
        assert not ran.exists() and not (out / "train").exists()
    finally:
        proc.kill()
        proc.wait(timeout=30)


# torchrun's part in a launch, for the test below: one "rank" that, stopped by SIGTERM, saves (writes the run
# folder it was given into the log) and ends as after a finished run
_ONE_RANK_TORCHRUN = """
import subprocess, sys
rank = '''
import signal, sys, time
def save(signum, frame):
    print("saved in", sys.argv[1], flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, save)
print("rank up", flush=True)
time.sleep(120)
'''
sys.exit(subprocess.run([sys.executable, "-c", rank, *sys.argv[1:]]).returncode)
"""


def test_a_cluster_launch_stopped_by_ctrl_c_stops_its_ranks_and_releases_the_lock(tmp_path):
    """``deploy/launch.sh``'s node step holds the training lock while torchrun runs; a Ctrl-C (SIGINT to it
    alone: torchrun is in a process group of its own) goes to the ranks as a SIGTERM, they save and end, and the
    launch exits 130 with the lock released."""
    import json

    out = tmp_path / "out"
    (out / "snapshots" / "0001-x").mkdir(parents=True)
    (out / "snapshots" / "0001-x" / "manifest.json").write_text("{}")
    (out / "snapshots" / "LATEST").write_text("0001-x\n")
    recipe_json = tmp_path / "recipe.json"
    recipe_json.write_text(json.dumps(load_recipe(DEMO_CONFIG, [f"output_dir={out}", "parallel.strategy=ddp"]).to_dict()))
    log = tmp_path / "launch.log"
    proc = subprocess.Popen([sys.executable, "-m", "latentmill.pipelines.runs", str(recipe_json), "2", "", "--",
                             sys.executable, "-c", _ONE_RANK_TORCHRUN], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        _wait_for(log, "rank up", proc)
        assert ": training since " in (out / TRAIN_LOCK).read_text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()
    (run,) = (out / "train" / "runs").iterdir()
    assert [line for line in log.read_text().splitlines() if line.startswith("saved in")] == [f"saved in {run}"]
    assert (out / TRAIN_LOCK).read_text() == ""  # released: the next training takes it without a word


_LOCK_THEN_NAME = """
import fcntl, os, socket, sys, time
with open(sys.argv[1], "a+") as fh:
    fcntl.flock(fh, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(0.6)  # the moment between a holder's flock and its line (writer_lock), drawn out
    fh.write(f"PID {os.getpid()} on {socket.gethostname()}: {sys.argv[2]} since 2026-12-03T00:00:00Z\\n")
    fh.flush()
    time.sleep(3600)
"""


def test_a_node_finding_the_lock_taken_but_not_yet_named_reads_the_name_and_joins(tmp_path, capsys):
    """Nodes start together: the second may find the first's flock before its line; it reads again, and joins
    (it would otherwise be refused by a holder it could not name)."""
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "first.log"
    holder = "training of rendezvous node1:29500/latentmill"
    proc = subprocess.Popen([sys.executable, "-c", _LOCK_THEN_NAME, str(out / TRAIN_LOCK), holder],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        _wait_for(log, "locked", proc)
        with training_lock(out, "node1:29500/latentmill"):
            pass
        assert f"{holder}: joining the training lock of {out} that this run's first node holds (PID {proc.pid} " in \
            capsys.readouterr().out
    finally:
        proc.kill()
        proc.wait(timeout=30)
