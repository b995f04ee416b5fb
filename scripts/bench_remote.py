#!/usr/bin/env python3
"""Remote-source benchmarks of stfs against a local S3 server (moto, on
127.0.0.1), reported as ratios against baselines measured in the same run
(never as pass/fail thresholds):

1. every tensor of a 1 GiB checkpoint read through a fresh mount (empty cache),
   at several --concurrency settings, by one reader (tensor after tensor) and
   by 8 readers at once, against boto3 downloading the same object with
   parallel ranged GETs (TransferConfig, 8 MiB parts, 16 threads);
2. the second read of every tensor (from the local cache) against a local
   mount of the same file (page cache warm for both);
3. mount + `ls` of a remote 10,000-tensor checkpoint: requests (counted at a
   proxy) and seconds;
4. where nginx is installed: the first read again from an https-style source
   served by nginx (a server that is not the bottleneck, as moto is: it reads
   the whole object for each ranged GET), against the same parallel ranged
   GETs scripted in Python (16 threads x 8 MiB, keep-alive connections);
5. commits to S3 (`--only commits` runs these alone): a metadata edit of a
   2 GiB object, bytes sent by stfs (counted at a proxy) against the object's
   size and time against boto3 downloading it, rewriting it with the edit
   (safetensors) and uploading it; a same-size overwrite of one 128 MiB
   tensor, bytes sent against the tensor's.

Usage: scripts/bench_remote.py [--stfs target/release/stfs] [--dir DIR] [--runs 3]
                               [--concurrency 4,8,16,32] [--moto-concurrency 16] [--moto-runs 1]
                               [--only reads|commits]
Needs root (or fusermount3), numpy, safetensors, boto3 and moto[server].
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "pylib"))
from stfs_fixtures import ROOT, Mount, add_stfs_option, timed  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "integration"))
from remote_servers import FaultProxy, Moto  # noqa: E402

BUCKET = "bench"


def mounted(stfs, src, mnt, log, options=()):
    """A mount at `mnt` (made if missing) that must succeed."""
    os.makedirs(mnt, exist_ok=True)
    return Mount(stfs, src, mnt, options, log, check=True)


def read_all(folder, names, readers=1):
    """Reads every tensor file of `folder`, by `readers` threads taking them in turn."""
    todo = list(names)
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                if not todo:
                    return
                name = todo.pop(0)
            with open(os.path.join(folder, name), "rb", buffering=0) as f:
                while f.read(1 << 20):
                    pass

    threads = [threading.Thread(target=work) for _ in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def sweep(stfs, work, url, names, options, settings, runs, baseline):
    """Reads every tensor through fresh mounts (empty caches) at each
    --concurrency of `settings`, by 1 and by 8 readers; prints each
    throughput as a multiple of the baseline's (`baseline`: its seconds)."""
    for conc in [int(c) for c in settings.split(",")]:
        row = []
        for readers in (1, 8):
            times = []
            for r in range(runs):
                cache = os.path.join(work, f"cache-{conc}-{readers}-{r}")
                m = mounted(stfs, url, os.path.join(work, "mnt"), os.path.join(work, "stfs.log"),
                            [*options, "--cache-dir", cache, "--concurrency", str(conc)])
                try:
                    times.append(timed(lambda: read_all(m.path, names, readers)))
                finally:
                    m.close(check=True)
                    shutil.rmtree(cache)
            row.append(baseline / statistics.median(times))
        print(f"  {conc:<20d} {row[0]:>8.2f}x {row[1]:>9.2f}x")


def boto3_download(client, key, threads=16):
    from boto3.s3.transfer import TransferConfig
    config = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=threads)
    with open(os.devnull, "wb") as sink:
        client.download_fileobj(BUCKET, key, sink, Config=config)


def python_ranged_gets(port, path, size, threads=16, part=8 << 20, into=None):
    """What people script by hand: a pool of threads, each with a keep-alive
    connection, GETting 8 MiB ranges (into memory, or written into file `into`)."""
    import concurrent.futures
    import http.client
    local = threading.local()

    def get(start):
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection("127.0.0.1", port)
        end = min(size, start + part) - 1
        local.conn.request("GET", path, headers={"Range": f"bytes={start}-{end}"})
        r = local.conn.getresponse()
        data = r.read()
        assert r.status == 206 and len(data) == end - start + 1
        if into is not None:
            os.pwrite(fd, data, start)
        return len(data)

    fd = os.open(into, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) if into else None
    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            assert sum(pool.map(get, range(0, size, part))) == size
    finally:
        if fd is not None:
            os.close(fd)
            os.unlink(into)


def nginx_server(work, root):
    """nginx on a free port serving `root`; returns (process, port) or None."""
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if nginx is None:
        return None
    from remote_servers import free_port, wait_for_port
    port = free_port()
    os.makedirs(os.path.join(work, "nginx-tmp"), exist_ok=True)
    conf = os.path.join(work, "nginx.conf")
    with open(conf, "w") as f:
        f.write(f"""daemon off; worker_processes 2; pid {work}/nginx.pid; error_log {work}/nginx.err;
{"user root;" if os.getuid() == 0 else ""}
events {{ worker_connections 1024; }}
http {{ access_log off; sendfile on; tcp_nopush on;
  client_body_temp_path {work}/nginx-tmp; proxy_temp_path {work}/nginx-tmp;
  fastcgi_temp_path {work}/nginx-tmp; uwsgi_temp_path {work}/nginx-tmp; scgi_temp_path {work}/nginx-tmp;
  server {{ listen 127.0.0.1:{port}; root {root}; }} }}
""")
    proc = subprocess.Popen([nginx, "-c", conf, "-p", work], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, proc=proc)
    return proc, port


def bench_commits(stfs, work, moto, client):
    """Section 5: commits to S3, one run each."""
    import json
    from safetensors import safe_open
    rng = np.random.default_rng(1)
    src = os.path.join(work, "edit.safetensors")
    tensors = {f"layers.{i}.weight": np.frombuffer(rng.bytes(128 << 20), dtype=np.uint8) for i in range(16)}
    tensors.update({f"layers.{i}.norm": rng.standard_normal(4096).astype(np.float32) for i in range(16)})
    save_file(tensors, src, metadata={"format": "pt"})
    del tensors
    size = os.path.getsize(src)
    client.upload_file(src, BUCKET, "edit.safetensors")
    proxy = FaultProxy(moto.port)
    try:
        m = mounted(stfs, f"s3://{BUCKET}/edit.safetensors", os.path.join(work, "mnt-edit"),
                    os.path.join(work, "stfs-edit.log"),
                    ["--endpoint", proxy.url, "--cache-dir", os.path.join(work, "cache-edit")])
        try:
            with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
                json.dump({"format": "pt", "chat_template": "{{ messages }}"}, f)
            proxy.reset()
            took = timed(lambda: subprocess.run([stfs, "commit", m.path], check=True, stdout=subprocess.DEVNULL))
            sent = sum(r["length"] for r in proxy.requests if r["method"] in ("PUT", "POST"))
            # A 128 MiB tensor overwritten, same size.
            new = os.path.join(work, "new.bin")
            with open(new, "wb") as f:
                f.write(rng.bytes(128 << 20))
            subprocess.run(["dd", f"if={new}", f"of={m.path}/layers.7.weight", "bs=8M", "conv=notrunc",
                            "status=none"], check=True)
            proxy.reset()
            took_overwrite = timed(lambda: subprocess.run([stfs, "commit", m.path], check=True,
                                                          stdout=subprocess.DEVNULL))
            sent_overwrite = sum(r["length"] for r in proxy.requests if r["method"] in ("PUT", "POST"))
        finally:
            m.close(check=True)
    finally:
        proxy.stop()

    def by_hand():
        got = os.path.join(work, "downloaded.safetensors")
        client.download_file(BUCKET, "edit.safetensors", got)
        with safe_open(got, framework="np") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        out = os.path.join(work, "edited.safetensors")
        save_file(t, out, metadata={"format": "pt", "chat_template": "{{ messages }}", "by": "hand"})
        del t
        client.upload_file(out, BUCKET, "edit.safetensors")
        os.unlink(got)
        os.unlink(out)

    base = timed(by_hand)
    print(f"commits to a local S3 server (moto), a {size / 2**30:.1f} GiB object, one run")
    print(f"  metadata edit: stfs sent {sent / 2**20:.1f} MiB = {sent / size:.4f}x the object; "
          f"{took:.2f} s = {took / base:.3f}x of boto3 download + edit + upload ({base:.1f} s)")
    print(f"  same-size overwrite of a 128 MiB tensor: stfs sent {sent_overwrite / 2**20:.1f} MiB = "
          f"{sent_overwrite / (128 << 20):.2f}x the tensor, {took_overwrite:.2f} s")


def main():
    ap = argparse.ArgumentParser()
    add_stfs_option(ap)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", default="4,8,16,32", help="settings tried against nginx")
    ap.add_argument("--moto-concurrency", default="16", help="settings tried against moto (slow: it reads "
                    "the whole object for each ranged GET)")
    ap.add_argument("--moto-runs", type=int, default=1)
    ap.add_argument("--only", choices=["reads", "commits"], default=None)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="stfs-bench-remote-", dir=args.dir)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    moto = Moto(os.path.join(work, "moto.log"))
    mounts = []
    try:
        client = moto.client()
        client.create_bucket(Bucket=BUCKET)
        if args.only != "reads":
            bench_commits(args.stfs, work, moto, client)
        if args.only == "commits":
            return
        src = os.path.join(work, "model.safetensors")
        rng = np.random.default_rng(0)
        # 1 GiB: 60 "layers" of 16 MiB and 64 small tensors, like a model's.
        tensors = {f"layers.{i}.weight": np.frombuffer(rng.bytes(16 << 20), dtype=np.uint8) for i in range(60)}
        tensors.update({f"layers.{i}.norm": rng.standard_normal(4096).astype(np.float32) for i in range(64)})
        save_file(tensors, src)
        client.upload_file(src, BUCKET, "model.safetensors")
        names = sorted(tensors)
        url = f"s3://{BUCKET}/model.safetensors"
        size = os.path.getsize(src)

        base = [timed(lambda: boto3_download(client, "model.safetensors")) for _ in range(args.moto_runs)]
        b = statistics.median(base)
        print(f"1 GiB checkpoint from a local S3 server (moto), median of {args.moto_runs}")
        print(f"  boto3 download_fileobj, 16 threads x 8 MiB ranged GETs: {b:.2f} s ({size / b / 1e6:.0f} MB/s) = 1.00x")
        print(f"  {'stfs --concurrency':20s} {'1 reader':>9s} {'8 readers':>10s}   (throughput as multiples of boto3's)")
        sweep(args.stfs, work, url, names, ["--endpoint", moto.endpoint], args.moto_concurrency, args.moto_runs, b)

        # Second read: from the cache, against a local mount of the same file.
        cache = os.path.join(work, "cache-second")
        remote = mounted(args.stfs, url, os.path.join(work, "mnt"), os.path.join(work, "stfs.log"),
                         ["--endpoint", moto.endpoint, "--cache-dir", cache])
        mounts.append(remote)
        local = mounted(args.stfs, src, os.path.join(work, "mnt-local"), os.path.join(work, "stfs-local.log"))
        mounts.append(local)
        read_all(remote.path, names)  # fills the cache
        read_all(local.path, names)  # warms the source's page cache
        cached = statistics.median([timed(lambda: read_all(remote.path, names)) for _ in range(args.runs)])
        direct = statistics.median([timed(lambda: read_all(local.path, names)) for _ in range(args.runs)])
        print(f"  second read, from the cache: {size / cached / 1e6:.0f} MB/s = {direct / cached:.2f}x "
              f"of a local mount of the same file ({size / direct / 1e6:.0f} MB/s)")
        for m in (remote, local):
            m.close(check=True)
        mounts.clear()

        # Mount + ls of 10,000 tensors, requests counted at a proxy.
        many = os.path.join(work, "many.safetensors")
        save_file({f"model.layers.{i}.mlp.weight": np.full(4, i, np.float32) for i in range(10_000)}, many)
        client.upload_file(many, BUCKET, "many.safetensors")
        proxy = FaultProxy(moto.port)
        try:
            times = []
            for r in range(args.runs):
                cache = os.path.join(work, f"cache-many-{r}")
                before = proxy.count("GET")

                def mount_and_ls():
                    m = mounted(args.stfs, f"s3://{BUCKET}/many.safetensors", os.path.join(work, "mnt"),
                                os.path.join(work, "stfs.log"), ["--endpoint", proxy.url, "--cache-dir", cache])
                    mounts.append(m)
                    subprocess.run(["ls", m.path], check=True, stdout=subprocess.DEVNULL)

                times.append(timed(mount_and_ls))
                requests = proxy.count("GET") - before
                mounts.pop().close(check=True)
            print(f"  mount + ls of a remote 10,000-tensor checkpoint: {statistics.median(times):.2f} s, "
                  f"{requests} request(s)")
        finally:
            proxy.stop()

        served = nginx_server(work, work)
        if served is None:
            print("  (nginx not installed: no HTTP figures)")
        else:
            proc, port = served
            try:
                url = f"http://127.0.0.1:{port}/model.safetensors"
                base = statistics.median([timed(lambda: python_ranged_gets(port, "/model.safetensors", size))
                                          for _ in range(args.runs)])
                print(f"1 GiB checkpoint from nginx on 127.0.0.1, median of {args.runs}")
                print(f"  Python, 16 threads x 8 MiB ranged GETs: {base:.2f} s ({size / base / 1e6:.0f} MB/s) = 1.00x")
                to_file = statistics.median([timed(lambda: python_ranged_gets(
                    port, "/model.safetensors", size, into=os.path.join(work, "download"))) for _ in range(args.runs)])
                print(f"  the same, written to a local file (a download): {base / to_file:.2f}x")
                print(f"  {'stfs --concurrency':20s} {'1 reader':>9s} {'8 readers':>10s}")
                sweep(args.stfs, work, url, names, [], args.concurrency, args.runs, base)
            finally:
                proc.terminate()
                proc.wait(10)
    finally:
        for m in mounts:
            m.close()  # (after an error: cleanup only)
        moto.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
