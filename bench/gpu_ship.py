"""Slim an fbgemm-gpu wheel so that it travels to a GPU machine in a few tens of MiB.

The fbgemm_gpu 1.6.0 CUDA wheel is 465 MB compressed, 2.5 GB unpacked: every library
carries the kernels of every table-batched-embedding variant (each optimizer, SSD, VBE,
no-bag, dense, inference) for three GPU generations (sm_80, sm_90a, sm_100a). Our trainer
on one Hopper GPU calls a handful of them. This script keeps every library and its host
code (so every op is still registered and ``import fbgemm_gpu`` works unchanged) and
zeroes, inside each library's ``.nv_fatbin`` section, the device code it does not need:

- every cubin not built for ``--keep_arch`` (default 90: H100/H200);
- the translation units of TBE variants we never launch (see ``DROP``): other optimizers,
  no-bag/VBE/SSD/dense/GWD/v2 kernels, and all of inference.

Zeroed payloads compress to nothing. A kernel we zeroed by mistake fails loudly at its
first launch ("no kernel image is available"), never silently, since CUDA loads modules
lazily (the default since CUDA 12.2; keep ``CUDA_MODULE_LOADING=LAZY``).

    python bench/gpu_ship.py fbgemm_gpu-1.6.0-cp312-cp312-manylinux_2_28_x86_64.whl .gpu/fbgemm
    # then, on the GPU machine, with torchrec's wheels in .gpu/whl (bench/RESULTS.md says which):
    GPU_STAGING=.gpu bash bench/gpu_bench.sh uvm     # or bench/gpu_device_run.sh

The fatbin layout (not documented by NVIDIA; as read by cuobjdump-like tools): a section
holds containers, each a 16-byte header (magic 0xBA55ED50, version u16, header size u16,
payload size u64) followed by entries, each a header (kind u16, version u16, header size
u32, payload size u64, compressed size u32, ..., arch u32 at offset 28, flags u64 at 40;
flag 0x8000: the payload is a zstd frame) and its payload. One container per CUDA
translation unit; its TU's file name survives in the cubin's mangled symbol names.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import struct
import subprocess
import sys
import tarfile
import zipfile

MAGIC = 0xBA55ED50
COMPRESSED = 0x8000

# Translation units (by file name, as in their mangled symbols) whose kernels we zero.
# We train with EXACT_ROWWISE_ADAGRAD on pooled, HBM-resident tables (weighted features kept).
DROP = re.compile(
    r"_(ssd|vbe|gwd|nobag|dense|v2)_"
    r"|^gen_embedding_backward_(?!rowwise_adagrad_split_)"
    r"|rowwise_adagrad_with_counter"
)
# Keep the kernels of these TUs even when DROP matches (helpers every variant calls).
KEEP = re.compile(r"^gen_embedding_backward_split_(grad_embedding_ops|indice_weights_codegen_cuda)$")
# Libraries whose device code we never launch at all (their ops stay registered).
DROP_ALL = {
    "fbgemm_gpu_tbe_inference.so",
    "fbgemm_gpu_tbe_training_backward_vbe.so",
    "fbgemm_gpu_tbe_training_backward_gwd.so",
    "fbgemm_gpu_tbe_training_backward_dense.so",
}
TU_NAME = re.compile(rb"INTERNAL_[0-9a-f]{8}_\d+_(\w+?)_cu_")


def fatbin_section(elf: bytes) -> tuple[int, int] | None:
    """(file offset, size) of the ``.nv_fatbin`` section of a 64-bit little-endian ELF."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    def sh(i: int) -> tuple[int, int, int]:
        name, _, _, _, off, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        return name, off, size
    _, stroff, _ = sh(shstrndx)
    for i in range(shnum):
        name, off, size = sh(i)
        end = elf.index(b"\0", stroff + name)
        if elf[stroff + name:end] == b".nv_fatbin":
            return off, size
    return None


def containers(data: bytearray, base: int, size: int):
    """Yield (container offset, [entries]) with each entry a dict of its fields."""
    pos, end_all = base, base + size
    while pos + 16 <= end_all:
        magic, _, hsz, fsz = struct.unpack_from("<IHHQ", data, pos)
        if magic != MAGIC:  # alignment padding between containers
            nxt = data.find(struct.pack("<I", MAGIC), pos, end_all)
            if nxt < 0:
                return
            pos = nxt
            continue
        entries, e, end = [], pos + hsz, pos + hsz + fsz
        while e < end:
            kind, _, ehsz, psize = struct.unpack_from("<HHIQ", data, e)
            csize, = struct.unpack_from("<I", data, e + 16)
            arch, = struct.unpack_from("<I", data, e + 28)
            flags, = struct.unpack_from("<Q", data, e + 40)
            entries.append({"kind": kind, "arch": arch, "flags": flags, "payload": e + ehsz, "size": psize, "csize": csize})
            e += ehsz + psize
        yield pos, entries
        pos = end


def tu_names(data: bytearray, entry: dict) -> set[str]:
    """File names of the translation unit(s) in one cubin entry (decompressing if needed)."""
    payload = bytes(data[entry["payload"]:entry["payload"] + entry["size"]])
    if entry["flags"] & COMPRESSED:
        payload = subprocess.run(["zstd", "-d", "-c"], input=payload[:entry["csize"]],
                                 capture_output=True, check=True).stdout  # fmt: skip
    return {m.decode() for m in TU_NAME.findall(payload)}


def slim_library(name: str, elf: bytes, keep_arch: int) -> tuple[bytearray, dict]:
    data = bytearray(elf)
    stats = {"zeroed": 0, "kept": 0, "kept_tus": [], "dropped_tus": 0}
    sec = fatbin_section(data)
    if sec is None:
        return data, stats
    for _, entries in containers(data, *sec):
        keep_entries = [e for e in entries if e["arch"] == keep_arch]
        drop_tu = name in DROP_ALL
        if not drop_tu and keep_entries:
            names = set().union(*(tu_names(data, e) for e in keep_entries))
            drop_tu = bool(names) and all(
                n.startswith("gen_embedding_") and DROP.search(n) and not KEEP.search(n) for n in names
            )
            if not drop_tu:
                stats["kept_tus"] += sorted(names)
        stats["dropped_tus"] += drop_tu
        for e in entries:
            if drop_tu or e["arch"] != keep_arch:
                data[e["payload"]:e["payload"] + e["size"]] = bytes(e["size"])
                stats["zeroed"] += e["size"]
            else:
                stats["kept"] += e["size"]
    return data, stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", help="fbgemm_gpu CUDA wheel (.whl)")
    parser.add_argument("out_dir", help="folder for fbgemm_gpu.tar.xz (split into parts if --part_mib)")
    parser.add_argument("--keep_arch", type=int, default=90, help="SM version whose cubins stay (default 90)")
    parser.add_argument("--part_mib", type=int, default=0, help="split the archive into parts of this many MiB")
    ns = parser.parse_args(argv)

    os.makedirs(ns.out_dir, exist_ok=True)
    out = os.path.join(ns.out_dir, "fbgemm_gpu.tar.xz")
    # Streamed through xz: the wheel unpacks to 2.5 GB, which need not sit in memory twice.
    with open(out, "wb") as packed_file:
        xz = subprocess.Popen(["xz", "-9", "-T0", "-c"], stdin=subprocess.PIPE, stdout=packed_file)
        assert xz.stdin is not None
        with zipfile.ZipFile(ns.wheel) as whl, tarfile.open(fileobj=xz.stdin, mode="w|") as tar:
            for info in whl.infolist():
                if info.is_dir():
                    continue
                blob = whl.read(info)
                base = os.path.basename(info.filename)
                if base.endswith(".so"):
                    slim, stats = slim_library(base, blob, ns.keep_arch)
                    blob = bytes(slim)
                    print(f"{base:52s} {len(blob) / 2**20:8.1f} MiB, device code kept "
                          f"{stats['kept'] / 2**20:6.1f} MiB, zeroed {stats['zeroed'] / 2**20:7.1f} MiB, "
                          f"TUs dropped {stats['dropped_tus']}", file=sys.stderr)  # fmt: skip
                ti = tarfile.TarInfo(info.filename)
                ti.size, ti.mode = len(blob), 0o755 if base.endswith(".so") else 0o644
                tar.addfile(ti, io.BytesIO(blob))
        xz.stdin.close()
        if xz.wait() != 0:
            raise SystemExit(f"gpu_ship: xz failed (exit {xz.returncode})")
    with open(out, "rb") as f:
        packed = f.read()
    if ns.part_mib:
        step = ns.part_mib * 2**20
        for i in range(0, len(packed), step):
            with open(f"{out}.part{i // step:02d}", "wb") as f:
                f.write(packed[i:i + step])
        os.remove(out)
    print(f"{out}: {len(packed) / 2**20:.1f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
