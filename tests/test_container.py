"""The container path that runs fast on a CPU machine: the image build against a stub base (real buildah, the real
Containerfile, a busybox base whose python3, pip and vitctl only record their arguments), its OCI archive and enroot
squashfs, the launch flags for pyxis, the version check at rank start and the no-JIT rule. The full image is built and
tested by `make image image-test` (containers/README.md)."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import ok, vitctl
from vitctl.trainer.ops import cuda
from vitctl.workflows import image
from vitctl.workflows.errors import LaunchError
from vitctl.workflows.job import TrainJob
from vitctl.workflows.provenance import IMAGE_COMMIT_ENV, vitctl_version

needs_tools = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("buildah", "mksquashfs", "unsquashfs", "busybox")),
    reason="needs root, buildah, squashfs-tools and busybox-static (containers/install-tools, which `make test` runs)")

# The stub base's commands: each appends its arguments to /stub.log. In the ops stage, pip wheel and bdist_wheel write
# a "wheel" holding their arguments and environment, which the final stage's pip install copies into its log.
STUB = r"""#!/bin/sh
echo "$(basename "$0") $*" >> /stub.log
case "$*" in
  *"pip wheel"*) mkdir -p /wheels && echo "vitctl: $* TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST" \
      > /wheels/vitctl-0.1.0-cp311-cp311-linux_x86_64.whl ;;
  *bdist_wheel*) echo "apex: $* APEX_CUDA_EXT=$APEX_CUDA_EXT from $(cat setup.py)" \
      > /wheels/apex-0.1-cp311-cp311-linux_x86_64.whl ;;
  *"pip install"*--no-deps*) cat /wheels/*.whl >> /stub.log ;;
  *torch.version.cuda*) echo 13 ;;
  *torchvision*) echo torch==2.11.0; echo torchvision==0.26.0 ;;
  *requires*) echo click>=8.1 ;;
esac
"""


def _stub_base(storage: Path, tmp: Path) -> str:
    """A busybox image whose python3 and vitctl are the stub above, committed to `storage` as localhost/stub-base."""
    rootfs = tmp / "stub-rootfs"
    (rootfs / "bin").mkdir(parents=True)
    shutil.copy(shutil.which("busybox"), rootfs / "bin/busybox")
    for applet in ("sh", "mkdir", "tar", "gzip", "rm", "touch", "cat", "basename", "test"):
        (rootfs / "bin" / applet).symlink_to("busybox")
    for command in ("python3", "vitctl"):
        (rootfs / "bin" / command).write_text(STUB)
        (rootfs / "bin" / command).chmod(0o755)
    (rootfs / "tmp").mkdir()
    tool = ["buildah", "--storage-driver", "vfs", "--root", str(storage), "--runroot", str(storage / "run")]
    ctr = subprocess.run([*tool, "from", "scratch"], check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([*tool, "copy", ctr, f"{rootfs}/", "/"], check=True, capture_output=True)
    subprocess.run([*tool, "config", "--env", "PATH=/bin", ctr], check=True, capture_output=True)
    subprocess.run([*tool, "commit", "--rm", ctr, "localhost/stub-base"], check=True, capture_output=True)
    return "localhost/stub-base"


def _apex_archive(tmp: Path) -> Path:
    source = tmp / "apex"
    source.mkdir()
    (source / "setup.py").write_text("# stands for apex's\n")
    archive = tmp / "apex-test.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname="apex")
    return archive


@needs_tools
def test_image_builds_on_a_stub_base_into_an_oci_archive_and_an_enroot_squashfs(tmp_path):
    storage = tmp_path / "storage"
    request = image.ImageRequest(_stub_base(storage, tmp_path), "localhost/vitctl-ci:test", tmp_path / "out", "9.0",
                                 _apex_archive(tmp_path), storage_root=storage)
    try:
        built = image.build(request, lambda text: None)
        tool = image.buildah(request)
        config = json.loads(subprocess.run([*tool, "inspect", "--type", "image", request.tag], check=True,
                                           capture_output=True, text=True).stdout)["OCIv1"]["config"]
        log = subprocess.run(["unsquashfs", "-cat", built.outputs.squashfs, "stub.log"], check=True,
                             capture_output=True, text=True).stdout
        environment = subprocess.run(["unsquashfs", "-cat", built.outputs.squashfs, "etc/environment"], check=True,
                                     capture_output=True, text=True).stdout.splitlines()
    finally:
        subprocess.run([*image.buildah(request), "rmi", "--all", "--force"], capture_output=True)
        shutil.rmtree(storage, ignore_errors=True)
    assert config["Labels"]["org.opencontainers.image.version"] == vitctl_version()
    assert config["Labels"]["ai.vitctl.cuda-arch-list"] == "9.0"
    assert "VITCTL_PREBUILT_OPS=1" in config["Env"] and "VITCTL_PREBUILT_OPS=1" in environment
    assert not (image.REPO / image.VENDOR / "apex-test.tar.gz").exists()  # staged only while building
    steps = log.splitlines()
    assert "vitctl: -m pip wheel --no-deps --no-build-isolation -w /wheels ./vitctl TORCH_CUDA_ARCH_LIST=9.0" in steps
    apex = "apex: ../containers/apex_subset.py bdist_wheel --dist-dir /wheels APEX_CUDA_EXT=1"
    assert f"{apex} from # stands for apex's" in steps  # built from the staged archive
    install = next(s for s in steps if "nvidia-dali-cuda130" in s)  # DALI for torch's CUDA 13
    assert "-c /tmp/keep-torch.txt" in install and "webdataset" in install
    assert steps[-1].startswith("vitctl doctor --expect-image")  # the self-test ends the build
    assert built.oci_bytes > 0 and tarfile.is_tarfile(built.outputs.oci_archive)
    assert sorted(p.name for p in request.out.iterdir()) == ["vitctl-ci-test.oci.tar", "vitctl-ci-test.sqsh"]


@needs_tools
def test_enroot_layout_of_a_tiny_rootfs(tmp_path):
    rootfs = tmp_path / "rootfs"
    (rootfs / "dev").mkdir(parents=True)
    (rootfs / "dev/null").write_text("")  # enroot leaves /dev to the runtime
    config = {"Env": ["PATH=/opt/venv/bin:/usr/bin", "VITCTL_PREBUILT_OPS=1"], "Labels": {"org.opencontainers."
              "image.version": "0.1.0"}, "WorkingDir": "/work", "Cmd": ["python3", "-m", "vitctl.cli"],
              "Volumes": {"/data": {}}}
    image.enroot_configure(rootfs, config)
    target = tmp_path / "tiny.sqsh"
    subprocess.run(image.squash_command(rootfs, target), check=True, capture_output=True)
    listing = subprocess.run(["unsquashfs", "-l", target], check=True, capture_output=True, text=True).stdout
    cat = {name: subprocess.run(["unsquashfs", "-cat", target, name], check=True, capture_output=True,
                                text=True).stdout for name in ("etc/environment", "etc/rc", "etc/fstab")}
    assert cat["etc/environment"] == "PATH=/opt/venv/bin:/usr/bin\nVITCTL_PREBUILT_OPS=1\n"
    assert cat["etc/rc"].startswith("# org.opencontainers.image.version 0.1.0\n")
    assert "cd /work && unset OLDPWD || exit 1" in cat["etc/rc"]
    assert '    exec "$@"' in cat["etc/rc"] and "    exec python3 -m vitctl.cli" in cat["etc/rc"]
    assert cat["etc/fstab"] == "${ENROOT_ROOTFS}/data /data none x-create=dir,bind,rw,nosuid,nodev\n"
    assert "squashfs-root/dev/null" not in listing and "squashfs-root/work" in listing


def test_image_build_dry_run_prints_the_commands(tmp_path):
    apex = tmp_path / "apex-x.tar.gz"
    out = ok("image", "build", "--dry-run", "--base", "localhost/vitctl-base:torch2.11.0", "--tag",
             "localhost/vitctl:ci", "--out", tmp_path / "img", "--arch-list", "9.0", "--apex", apex).output
    lines = out.splitlines()
    bud = next(line for line in lines if " bud " in line)
    for part in ["--isolation chroot", "-f containers/Containerfile",
                 "--build-arg BASE_IMAGE=localhost/vitctl-base:torch2.11.0", "--build-arg TORCH_CUDA_ARCH_LIST=9.0",
                 f"--build-arg VITCTL_VERSION={vitctl_version()}",
                 "--build-arg APEX_ARCHIVE=containers/vendor/apex-x.tar.gz"]:
        assert part in bud, part
    img = tmp_path / "img"  # each output written under a .partial name, renamed once complete
    assert f"push localhost/vitctl:ci oci-archive:{img}/vitctl-ci.oci.tar.partial:localhost/vitctl:ci" in out
    assert f"mv {img}/vitctl-ci.oci.tar.partial {img}/vitctl-ci.oci.tar" in lines
    assert f'mksquashfs "$rootfs" {img}/vitctl-ci.sqsh.partial -all-root' in out
    assert lines[-1] == f"mv {img}/vitctl-ci.sqsh.partial {img}/vitctl-ci.sqsh"
    assert not (tmp_path / "img").exists()


@pytest.mark.parametrize("tag", ["", "Vitctl:ci", "MyTeam/vitctl", "localhost/vitctl:", "vitctl:ci tag", "a//b"])
def test_a_tag_buildah_would_refuse_is_refused_before_the_build(tmp_path, tag):
    result = vitctl("image", "build", "--dry-run", "--tag", tag, "--out", tmp_path / "img")
    assert result.exit_code == 2 and f"{tag!r} is not an image name: lowercase name components" in result.stderr
    assert not (tmp_path / "img").exists()


@pytest.mark.parametrize("tag", ["vitctl", "localhost/vitctl:ci", "nvcr.io/nvidia/pytorch:25.10-py3",
                                 "registry.example.org:5000/team/vit_ctl:v1.2_rc-3", "gpuhost:5000/vitctl"])
def test_tags_buildah_takes_pass(tmp_path, tag):
    assert f" -t {tag} " in ok("image", "build", "--dry-run", "--tag", tag, "--out", tmp_path / "img").output


def test_missing_build_tools_are_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    result = vitctl("image", "build", "--out", tmp_path)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "needs buildah and mksquashfs: apt-get install buildah squashfs-tools" in result.stderr


# ---------------------------------------------------------------- launching ranks in the image


def test_train_with_a_squashfs_image_mounts_the_run_and_data_folders(prepared_shards, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no sbatch: the dry run is not checked
    monkeypatch.chdir(tmp_path)
    sqsh, data = tmp_path / "vitctl.sqsh", prepared_shards
    sqsh.write_bytes(b"hsqs")
    script = ok("train", "--config", "demo_vit", "--set", "model.num_classes=5", "--data", data, "--out",
                tmp_path / "run", "--executor", "slurm", "--gpus", 2, "--batch", 4, "--container-image", "vitctl.sqsh",
                "--container-mounts", "/scratch:/scratch", "--dry-run").output
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert srun == (f"srun --container-image={sqsh} --container-mounts=/scratch:/scratch,{tmp_path}/run:{tmp_path}/run,"
                    f'{data}:{data} python3 -m vitctl.cli rank --config "$config"')


def test_a_missing_image_file_and_a_local_image_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    common = ["train", "--config", "demo_vit", "--set", "data.source=synthetic", "--out", tmp_path / "run"]
    result = vitctl(*common, "--executor", "slurm", "--gpus", 8, "--container-image", tmp_path / "no.sqsh", "--dry-run")
    assert result.exit_code == 1 and f"--container-image {tmp_path}/no.sqsh: no such file" in result.stderr
    result = vitctl(*common, "--executor", "local", "--gpus", 0, "--container-image", "x.sqsh")
    assert result.exit_code == 1 and "use it with --executor slurm" in result.stderr


def test_a_rank_refuses_a_job_pickled_by_another_vitctl(monkeypatch):
    job = TrainJob({"train": {"out_dir": "/nonexistent"}}, vitctl_version="0.0.1", git_commit="a" * 40)
    with pytest.raises(LaunchError, match=r"submitted by vitctl 0\.0\.1 \(commit aaaaaaaaaaaa\) but this rank runs "
                                          rf"vitctl {vitctl_version()}"):
        job()
    monkeypatch.setenv(IMAGE_COMMIT_ENV, "b" * 40)  # same version, an image of another commit
    same_version = TrainJob({"train": {"out_dir": "/nonexistent"}}, vitctl_version=vitctl_version(),
                            git_commit="a" * 40)
    with pytest.raises(LaunchError, match=r"runs vitctl .* \(commit bbbbbbbbbbbb\) \(the container image\)"):
        same_version()


def test_in_the_image_a_missing_op_is_an_error_not_a_build(monkeypatch):
    import torch.utils.cpp_extension

    def no_build(*args, **kwargs):
        raise AssertionError("a just-in-time build was started")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    monkeypatch.setenv(cuda.PREBUILT_ONLY_ENV, "1")
    monkeypatch.setattr(cuda, "prebuilt", lambda: (None, "No module named 'vitctl_cuda_ops'"))
    cuda.extension.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="not prebuilt here .* VITCTL_PREBUILT_OPS=1 forbids building it"):
            cuda.extension()
    finally:
        cuda.extension.cache_clear()


def test_doctor_in_an_image_without_apex_exits_1_naming_what_is_missing(monkeypatch):
    monkeypatch.setenv(cuda.PREBUILT_ONLY_ENV, "1")  # as in the image: the self-test runs without --expect-image
    result = vitctl("doctor")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "the image lacks" in result.stderr and "apex: fused_layer_norm_cuda" in result.stderr
    assert "container image self-test" in result.output
