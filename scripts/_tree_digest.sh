# tree_digest: sha256 (12 hex digits) of the Python files under src/ and tests/, by path and
# content, in a fixed order; the same on this machine and on the device's copy of the tree
# (sourced by scripts/stamp and scripts/gpu-check).
tree_digest() {
    find src tests -type f -name '*.py' -not -path '*/__pycache__/*' | LC_ALL=C sort \
        | while read -r f; do printf '%s  ' "$f"; sha256sum < "$f" | cut -c1-64; done | sha256sum | cut -c1-12
}
