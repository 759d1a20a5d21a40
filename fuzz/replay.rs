// The committed inputs of a fuzz target, for the tests that replay them on
// stable: `include!("../../fuzz/replay.rs")` in the `tests` module of the
// `fuzzing` module of proto, authority, ops, proxy-server and proxy-agent
// (one file rather than a crate: those five share no dependency, and the
// corpora it reads sit beside it).

/// The committed inputs of `target`: its corpus
/// (`fuzz/corpus/<target>/`) and the inputs of the crashes it found
/// (`fuzz/regressions/<target>/`, kept whatever their coverage).
fn corpus(target: &str) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let fuzz = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let dir = fuzz.join("corpus").join(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    assert!(
        files.len() >= 4,
        "{}: only {} inputs",
        dir.display(),
        files.len()
    );
    if let Ok(found) = std::fs::read_dir(fuzz.join("regressions").join(target)) {
        files.extend(found.map(|entry| entry.unwrap().path()));
    }
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let bytes = std::fs::read(&path).unwrap();
            (path, bytes)
        })
        .collect()
}

/// A test per target, `$test`, that runs the harness `$target` on each of
/// the target's committed inputs (its corpus is named as the harness) and
/// checks its heap at the peak against `$bound` of the input's length, as
/// the fuzz runs do (`heap-count`, installed in the crate's test build).
/// With `reaching $reach` (a predicate on what the harness returns, where
/// the return says how far an input got), at least one input must satisfy
/// it: a corpus that never reaches the harness's deep end fails.
macro_rules! replay {
    ($($test:ident => $target:ident within $bound:ident $(reaching $reach:expr)?),+ $(,)?) => {$(
        #[doc = concat!("Every input of the `", stringify!($target), "` corpus, replayed.")]
        #[test]
        fn $test() {
            assert!(
                heap_count::installed(),
                "the test build does not count its heap (heap_count::Counting)"
            );
            #[allow(unused_mut, unused_variables)]
            let mut reached = 0usize;
            for (path, input) in corpus(stringify!($target)) {
                eprintln!("{}", path.display());
                let bound = $bound(input.len());
                let mut returned = None;
                if let Err(over) = heap_count::within(bound, || {
                    returned = Some($target(&input));
                }) {
                    panic!("{}: {over} for {} input bytes", path.display(), input.len());
                }
                $(
                    let reach = $reach;
                    if returned.as_ref().is_some_and(reach) {
                        reached += 1;
                    }
                )?
                let _ = returned;
            }
            $(
                let _ = stringify!($reach);
                assert!(
                    reached > 0,
                    "no input of the {} corpus got as far as {}",
                    stringify!($target),
                    stringify!($reach)
                );
            )?
        }
    )+};
}
