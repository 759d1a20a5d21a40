//! The mutation evidence is a file, not prose: `scripts/mutants` runs
//! cargo-mutants over the soak's judge, the sabotaged run's verdict and
//! the router fuzz oracle's cost bounds, and writes every mutant's outcome
//! to `docs/mutants.tsv` with the commit it ran at. The survivors
//! docs/reliability.md names and explains (its "Survivors" table: file,
//! function, mutation) must be exactly the mutants that file says were
//! missed: a mutant caught since, or a new one missed, fails here until
//! the docs say so.

use std::collections::BTreeSet;

use integration_tests::workspace;

/// One mutant: its file, its function and the mutation, as cargo-mutants
/// words it.
type Mutant = (String, String, String);

/// The outcomes file's header line and its missed mutants.
fn missed_in(outcomes: &str) -> (String, BTreeSet<Mutant>) {
    let header = outcomes.lines().next().unwrap_or_default().to_owned();
    let missed = outcomes
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            assert_eq!(fields.len(), 5, "docs/mutants.tsv: not 5 fields: {line:?}");
            (fields[1] == "missed").then(|| {
                (
                    fields[2].to_owned(),
                    fields[3].to_owned(),
                    fields[4].to_owned(),
                )
            })
        })
        .collect();
    (header, missed)
}

/// The cells of a Markdown table row, `\|` read as a `|` within a cell
/// and backticks dropped.
fn cells(row: &str) -> Vec<String> {
    row.replace("\\|", "\u{0}")
        .trim()
        .trim_matches('|')
        .split('|')
        .map(|c| c.trim().replace('\u{0}', "|").replace('`', ""))
        .collect()
}

/// The rows of the first table after the heading `#### Survivors`.
fn documented(reliability: &str) -> BTreeSet<Mutant> {
    let from = reliability
        .find("#### Survivors")
        .expect("docs/reliability.md has a \"#### Survivors\" section");
    reliability[from..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|row| {
            let c = cells(row);
            assert!(
                c.len() >= 3,
                "a survivors row without file, function and mutation: {row}"
            );
            (c[0].clone(), c[1].clone(), c[2].clone())
        })
        .collect()
}

#[test]
fn the_documented_survivors_are_the_outcomes_files_missed_mutants() {
    let root = workspace();
    let outcomes = std::fs::read_to_string(root.join("docs/mutants.tsv")).unwrap();
    let reliability = std::fs::read_to_string(root.join("docs/reliability.md")).unwrap();
    let (header, missed) = missed_in(&outcomes);
    assert!(
        header.starts_with("# scripts/mutants") && header.contains(" at commit "),
        "docs/mutants.tsv must say what wrote it and at which commit: {header:?}"
    );
    let documented = documented(&reliability);
    let undocumented: Vec<&Mutant> = missed.difference(&documented).collect();
    let caught_since: Vec<&Mutant> = documented.difference(&missed).collect();
    assert!(
        undocumented.is_empty() && caught_since.is_empty(),
        "missed in docs/mutants.tsv but not in docs/reliability.md's survivors: {undocumented:#?}\n\
         in the survivors but not missed in docs/mutants.tsv: {caught_since:#?}"
    );
}

#[test]
fn a_survivors_table_is_read_cell_by_cell() {
    let text = "#### Survivors\n\ntext\n\n| file | function | mutation | why |\n| --- | --- | --- | --- |\n\
                | `a.rs` | `f` | replace `&&` with `\\|\\|` | equivalent |\n\nafter\n| x | y | z |\n";
    let rows = documented(text);
    assert_eq!(
        rows.into_iter().collect::<Vec<_>>(),
        [(
            "a.rs".to_owned(),
            "f".to_owned(),
            "replace && with ||".to_owned()
        )]
    );
    let (header, missed) = missed_in(
        "# scripts/mutants: cargo-mutants 1 at commit abc\n# scope\toutcome\tfile\tfunction\tmutation\n\
         judge\tmissed\ta.rs\tf\treplace && with ||\njudge\tcaught\ta.rs\tg\treplace g with ()\n",
    );
    assert!(header.contains("at commit abc"));
    assert_eq!(missed.len(), 1);
}
