// The fuzz input read as a sequence of choices, for the harnesses of ops,
// proxy-server and proxy-agent: `include!("../../fuzz/input.rs")` in their
// `fuzzing` modules (one file rather than a crate, as `replay.rs`). Each
// harness uses the choices it needs.

/// Reads fuzz bytes as choices; past the end every choice is 0.
struct Input<'a>(&'a [u8]);

// Not every harness takes every kind of choice.
#[allow(dead_code)]
impl<'a> Input<'a> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((first, rest)) => {
                self.0 = rest;
                *first
            }
            None => 0,
        }
    }

    fn below(&mut self, n: usize) -> usize {
        usize::from(self.byte()) % n.max(1)
    }

    fn bytes(&mut self, max: usize) -> &'a [u8] {
        let len = self.below(max + 1).min(self.0.len());
        let (taken, rest) = self.0.split_at(len);
        self.0 = rest;
        taken
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A protocol id: mostly small (so that ids meet), sometimes extreme.
    fn id(&mut self) -> i64 {
        match self.byte() {
            250 => i64::MAX,
            251 => i64::MIN,
            252 => -1,
            b => i64::from(b % 8),
        }
    }
}
