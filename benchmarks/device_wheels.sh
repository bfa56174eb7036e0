# Sourced by the device scripts: `install_wheels` installs the carried wheels of the folders given (default .whl)
# into /tmp/site and puts it on PYTHONPATH (folders without wheels are skipped; a failed install exits);
# `end_step NAME T0 SUMMARY` closes a step of a multi-step script.
install_wheels() {
    local dirs=("${@:-.whl}") whls=() d
    for d in "${dirs[@]}"; do compgen -G "$d/*.whl" >/dev/null && whls+=("$d"/*.whl); done
    [ ${#whls[@]} -gt 0 ] || return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${whls[@]}" || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

end_step() {  # name, the step's start ($SECONDS), the summary file
    # Whatever a timed-out step left (an engine and its spawned workers) would hold the GPUs' memory.
    pkill -9 -f "python3 -m pagedllm|multiprocessing.spawn|multiprocessing.resource_tracker" && sleep 3
    echo "($1: $((SECONDS - $2)) s)" >> "$3"
}
