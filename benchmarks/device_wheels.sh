# Sourced by the device scripts: installs the carried wheels of the folders given (default .whl) into
# /tmp/site and puts it on PYTHONPATH. Folders without wheels are skipped; a failed install exits.
install_wheels() {
    local dirs=("${@:-.whl}") whls=() d
    for d in "${dirs[@]}"; do compgen -G "$d/*.whl" >/dev/null && whls+=("$d"/*.whl); done
    [ ${#whls[@]} -gt 0 ] || return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${whls[@]}" || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}
