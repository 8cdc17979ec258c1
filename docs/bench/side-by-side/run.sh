#!/usr/bin/env bash
# Side-by-side benchmark of distlock at two commits (README.md beside this
# file). Builds both into one binary and runs it once; options after the
# script name go to the binary (--quick, --rounds N, --per-round N, ...).
#
#   OLD_REF   the old commit (default 89231f2)
#   OLD_API   `before` (default): the old side is called with the API of
#             89231f2 and older; `current`: with today's (`postgres::TableLocker`,
#             a fallible `build()`), for an OLD_REF after the rewrite, e.g.
#             OLD_REF=HEAD for an A/A run (the same code on both sides)
#   NEW_REF   the new commit (default HEAD)
#   NEW_PATH  build the new side from this checkout instead of NEW_REF
#             (e.g. the repository itself, to include uncommitted changes)
#   SBS_DIR   scratch directory (default: a new one under /tmp); the
#             worktrees in it are removed at the end, the build is kept
#   SBS_DATABASE_URL  the server (default postgres://postgres@127.0.0.1:5432/postgres);
#             the binary creates and drops the databases sbs_old and sbs_new
#
# Touches no tracked file of the repository: the commits are checked out as
# detached worktrees in the scratch directory, and the one edit (the old
# package's version) is made there.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel)
OLD_REF=${OLD_REF:-89231f2}
NEW_REF=${NEW_REF:-HEAD}
work=${SBS_DIR:-$(mktemp -d /tmp/distlock-sbs.XXXXXX)}
mkdir -p "$work"
work=$(cd "$work" && pwd)

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$work/target}
export CARGO_INCREMENTAL=0

worktrees=()
cleanup() {
    for w in "${worktrees[@]}"; do
        git -C "$repo" worktree remove --force "$w" || true
    done
    git -C "$repo" worktree prune
}
trap cleanup EXIT

# 1. The old code, as a detached worktree; its package version becomes
#    0.0.1 (0.0.x and 0.1.x are semver-incompatible, so Cargo takes both).
rm -rf "$work/old" "$work/new"
git -C "$repo" worktree add --detach "$work/old" "$OLD_REF"
worktrees+=("$work/old")
sed -i '0,/^version = /s/^version = .*/version = "0.0.1"/' "$work/old/Cargo.toml"

if [[ -n ${NEW_PATH:-} ]]; then
    new=$(cd "$NEW_PATH" && pwd)
else
    git -C "$repo" worktree add --detach "$work/new" "$NEW_REF"
    worktrees+=("$work/new")
    new=$work/new
fi

# 2. The scratch crate, outside the repository, with the new side's lock
#    file as the starting point (Cargo adds what the old side needs).
mkdir -p "$work/crate/src"
sed -e "s#@OLD@#$work/old#" -e "s#@NEW@#$new#" \
    "$here/Cargo.toml.template" >"$work/crate/Cargo.toml"
cp "$here/main.rs" "$work/crate/src/main.rs"
case ${OLD_API:-before} in
before) ;;
current)
    # The two calls whose API changed in the rewrite, on the old side only.
    sed -i -e 's/distlock_old::TableLocker/distlock_old::postgres::TableLocker/g' \
        -e 's/^\( *\)\.build(),$/\1.build()?,/' "$work/crate/src/main.rs"
    ;;
*)
    echo "OLD_API must be 'before' or 'current'" >&2
    exit 2
    ;;
esac
cp "$new/Cargo.lock" "$work/crate/Cargo.lock"

echo "old: $(git -C "$work/old" rev-parse --short HEAD) (called with the ${OLD_API:-before} API)  new: $(git -C "$new" rev-parse --short HEAD)$([[ -n $(git -C "$new" status --porcelain --untracked-files=no) ]] && echo ' (with uncommitted changes)')"
echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
echo "server: $(psql "${SBS_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}" -Atc 'select version()' 2>/dev/null || echo '?')"

cd "$work/crate"
cargo build --release
# The binary prints the load before and after its run itself.
"$CARGO_TARGET_DIR/release/distlock-side-by-side" "$@"
