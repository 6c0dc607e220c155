//! The seeds of the randomized tests.
//!
//! A randomized test draws everything it chooses (a fault schedule, which
//! process to kill and when, which mode an attempt takes) from one seed,
//! prints it, and replays from it. Where it runs is not in the seed: other
//! processes' timing is the machine's, so a replay repeats the choices,
//! not every interleaving.
//!
//! - In CI each randomized test runs the fixed seeds listed for it in
//!   `tests/seeds.txt`: a run is the same work every time, and a red run
//!   names a seed to replay.
//! - `DLOCK_SEED=<seed>` runs every selected randomized test with that one
//!   seed: the replay of a red run.
//! - `DLOCK_FRESH_SEEDS=<n>` adds `n` fresh random seeds to each test's
//!   list, for long runs on a developer's machine.
//! - A seed that found a bug of dlock joins the test's list in
//!   `tests/seeds.txt`, with a comment that names the bug.

/// The file of fixed seeds, read at compile time so a test binary needs no
/// source tree to run.
const SEEDS_FILE: &str = include_str!("../seeds.txt");

/// The seeds `test` runs (see the module docs), never empty: a test with no
/// line in `tests/seeds.txt` panics, so that CI never runs a fresh seed
/// nobody can name in advance.
pub fn seeds(test: &str) -> Vec<u64> {
    if let Some(seed) = env_seed("DLOCK_SEED") {
        return vec![seed];
    }
    let mut seeds = fixed(SEEDS_FILE, test);
    assert!(
        !seeds.is_empty(),
        "tests/seeds.txt has no seed for the randomized test `{test}`: add a line `{test} <seed>`"
    );
    let fresh = match std::env::var("DLOCK_FRESH_SEEDS") {
        Ok(n) => n.trim().parse::<usize>().unwrap_or_else(|_| {
            panic!("DLOCK_FRESH_SEEDS must be a whole number of seeds, not {n:?}")
        }),
        Err(_) => 0,
    };
    seeds.extend((0..fresh).map(|_| fresh_seed()));
    seeds
}

/// The first of [`seeds`], for a test that runs one seed at a time and
/// takes fresh ones only through `DLOCK_SEED`.
pub fn seed(test: &str) -> u64 {
    seeds(test)[0]
}

/// What a test prints before it runs `seed`, so a red run says how to
/// replay it.
pub fn announce(test: &str, seed: u64) {
    eprintln!("{test}: seed {seed} (DLOCK_SEED={seed} replays it)");
}

/// A seed from the environment variable `name`, if it is set and a number.
pub fn env_seed(name: &str) -> Option<u64> {
    let text = std::env::var(name).ok()?;
    match text.trim().parse() {
        Ok(seed) => Some(seed),
        Err(_) => panic!("{name} must be a decimal u64, not {text:?}"),
    }
}

/// A seed no run has used before.
pub fn fresh_seed() -> u64 {
    let id = dlock::backend::OwnerId::random().expect("random bytes");
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&id.as_bytes()[..8]);
    u64::from_le_bytes(bytes)
}

/// The seeds `text` lists for `test`: lines `<test> <seed>`, `#` starting
/// a comment.
fn fixed(text: &str, test: &str) -> Vec<u64> {
    text.lines()
        .map(|line| line.split('#').next().unwrap_or("").trim())
        .filter_map(|line| {
            let (name, seed) = line.split_once(char::is_whitespace)?;
            (name == test).then(|| {
                seed.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("tests/seeds.txt: `{seed}` is not a u64 seed"))
            })
        })
        .collect()
}

/// One step of SplitMix64 (Steele, Lea and Flood), the generator every
/// randomized test draws from: advances `state` and returns 64 bits.
pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    mix(*state)
}

/// SplitMix64's finaliser: also how a run's base seed spreads into the
/// seeds of its parts.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
