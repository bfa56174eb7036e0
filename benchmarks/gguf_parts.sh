#!/usr/bin/env bash
# The real SmolLM2 GGUF (98 MB) on the device, whose calls carry at most 64 MiB with the tracked tree (~36 MB):
# four parts of ~25 MB, one call each, each call within the machine's idle window of the one before.
#   here:    bash benchmarks/gguf_parts.sh make          (writes .gguf/s1 .. .gguf/s4, ignored by git)
#   device:  bash benchmarks/gguf_parts.sh stage         (carry .gguf/s1, then .gguf/s2, .gguf/s3: copies the part
#            to /tmp); last call: carry .gguf/s4, run `bash benchmarks/gguf_parts.sh stage` first;
#            /tmp/smollm2.gguf is assembled and checked against the sha256 when all four parts are there.
set -euo pipefail
PARTS=4
case ${1:-stage} in
    make)
        src=$(python3 -c "from pagedllm.transformers_utils.config import default_model_path; print(default_model_path())")
        rm -rf .gguf && mkdir -p .gguf
        size=$(stat -c %s "$src")
        split -b $(( (size + PARTS - 1) / PARTS )) -d -a 1 "$src" /tmp/smol.p
        for i in $(seq 1 $PARTS); do mkdir -p .gguf/s$i && mv /tmp/smol.p$((i - 1)) .gguf/s$i/; done
        sha256sum "$src" | cut -d' ' -f1 > .gguf/s$PARTS/sha256
        ls -la .gguf/s* ;;
    stage)
        for d in .gguf/s*; do [ -d "$d" ] && cp "$d"/* /tmp/; done
        parts=$(for i in $(seq 0 $((PARTS - 1))); do echo /tmp/smol.p$i; done)
        if ls $parts /tmp/sha256 >/dev/null 2>&1; then
            cat $parts > /tmp/smollm2.gguf
            if [ "$(sha256sum /tmp/smollm2.gguf | cut -d' ' -f1)" = "$(cat /tmp/sha256)" ]; then
                echo "/tmp/smollm2.gguf assembled"
            else
                echo "GGUF sha256 mismatch" && rm -f /tmp/smollm2.gguf
            fi
        else
            ls -la /tmp/smol.p* 2>/dev/null || true
        fi ;;
esac
