#!/usr/bin/env bash
# The real SmolLM2 GGUF (98 MB) on the device, whose calls carry at most 64 MiB with the tracked tree (~29 MB):
# three parts, one call each, each call within the machine's idle window of the one before.
#   here:    bash benchmarks/gguf_parts.sh make          (writes .gguf/s1 .gguf/s2 .gguf/s3, ignored by git)
#   device:  bash benchmarks/gguf_parts.sh stage         (carry .gguf/s1, then .gguf/s2: copies the part to /tmp)
#            last call: carry .gguf/s3, run `bash benchmarks/gguf_parts.sh stage` first; /tmp/smollm2.gguf is
#            assembled and checked against the sha256 when all three parts are there.
set -euo pipefail
case ${1:-stage} in
    make)
        src=$(python3 -c "from pagedllm.transformers_utils.config import default_model_path; print(default_model_path())")
        rm -rf .gguf/s1 .gguf/s2 .gguf/s3 && mkdir -p .gguf/s1 .gguf/s2 .gguf/s3
        size=$(stat -c %s "$src")
        part=$(( (size + 2) / 3 ))
        split -b "$part" -d -a 1 "$src" /tmp/smol.p
        mv /tmp/smol.p0 .gguf/s1/ && mv /tmp/smol.p1 .gguf/s2/ && mv /tmp/smol.p2 .gguf/s3/
        sha256sum "$src" | cut -d' ' -f1 > .gguf/s3/sha256
        ls -la .gguf/s1 .gguf/s2 .gguf/s3 ;;
    stage)
        for d in .gguf/s1 .gguf/s2 .gguf/s3; do [ -d "$d" ] && cp "$d"/* /tmp/; done
        if [ -f /tmp/smol.p0 ] && [ -f /tmp/smol.p1 ] && [ -f /tmp/smol.p2 ] && [ -f /tmp/sha256 ]; then
            cat /tmp/smol.p0 /tmp/smol.p1 /tmp/smol.p2 > /tmp/smollm2.gguf
            if [ "$(sha256sum /tmp/smollm2.gguf | cut -d' ' -f1)" = "$(cat /tmp/sha256)" ]; then
                echo "/tmp/smollm2.gguf assembled"
            else
                echo "GGUF sha256 mismatch" && rm -f /tmp/smollm2.gguf
            fi
        else
            ls -la /tmp/smol.p* 2>/dev/null || true
        fi ;;
esac
