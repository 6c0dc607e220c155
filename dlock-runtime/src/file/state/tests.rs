//! Unit tests of the state file's format: what each version writes and
//! reads, and what a damaged or foreign file reads as.

use super::*;

#[test]
fn state_round_trips_with_odd_keys() {
    let state = State {
        counter: 42,
        owner: OwnerId::random().ok(),
        expires_at_us: 1_700_000_000_000_000,
        key: "a\nb key \"quoted\"\nü".into(),
        identity: None,
        holder: None,
        queued: false,
        group: false,
        members: Vec::new(),
        marks: Vec::new(),
    };
    assert_eq!(parse_state(&render_state(&state)), Some(state));
}

fn held_as(identity: &str) -> State {
    State {
        counter: 7,
        owner: OwnerId::random().ok(),
        expires_at_us: 1_700_000_000_000_000,
        key: "a\nkey with\nidentity x\nlines".into(),
        identity: Some(identity.into()),
        holder: None,
        queued: false,
        group: false,
        members: Vec::new(),
        marks: Vec::new(),
    }
}

#[test]
fn state_round_trips_with_an_identity() {
    let state = held_as("web-3 (pid 4121)");
    assert_eq!(parse_state(&render_state(&state)), Some(state));
}

#[test]
fn identities_with_separators_newlines_and_percent_signs_round_trip() {
    for identity in [
        "",
        " ",
        "a b",
        "line\nbreak\r\n",
        "100% %41 %",
        "\0identity 00 x",
        "tab\there ü ∑ 🦀",
        "%%%%",
    ] {
        let state = held_as(identity);
        let text = render_state(&state);
        assert_eq!(
            text.lines().count(),
            state.key.lines().count() + 5,
            "{identity:?} stays on one line"
        );
        assert_eq!(parse_state(&text), Some(state), "{identity:?}");
    }
}

#[test]
fn a_state_of_the_earlier_format_parses_without_identity() {
    let owner = OwnerId::random().expect("random");
    let text = format!(
        "{STATE_HEADER}\ncounter 12\nowner {owner}\nexpires_us 99\nkey a\nb\nidentity {owner} x"
    );
    assert_eq!(
        parse_state(&text),
        Some(State {
            counter: 12,
            owner: Some(owner),
            expires_at_us: 99,
            key: format!("a\nb\nidentity {owner} x"),
            identity: None,
            holder: None,
            queued: false,
            group: false,
            members: Vec::new(),
            marks: Vec::new(),
        })
    );
}

#[test]
fn a_state_without_identity_is_written_in_the_earlier_format() {
    let owner = OwnerId::random().expect("random");
    let state = State {
        counter: 12,
        owner: Some(owner),
        expires_at_us: 99,
        key: "k".into(),
        identity: None,
        holder: None,
        queued: false,
        group: false,
        members: Vec::new(),
        marks: Vec::new(),
    };
    assert_eq!(
        render_state(&state),
        format!("{STATE_HEADER}\ncounter 12\nowner {owner}\nexpires_us 99\nkey k")
    );
}

/// The parser of the version before identities, verbatim.
fn parse_earlier(text: &str) -> Option<(u64, Option<OwnerId>, u64)> {
    let mut lines = text.splitn(5, '\n');
    if lines.next()? != STATE_HEADER {
        return None;
    }
    let counter = lines.next()?.strip_prefix("counter ")?.parse().ok()?;
    let owner = match lines.next()?.strip_prefix("owner ")? {
        "-" => None,
        hex => Some(OwnerId::parse_hex(hex)?),
    };
    let expires_at_us = lines.next()?.strip_prefix("expires_us ")?.parse().ok()?;
    lines.next()?.strip_prefix("key ")?;
    Some((counter, owner, expires_at_us))
}

#[test]
fn an_earlier_version_reads_a_state_with_an_identity() {
    let state = held_as("leader\nof all");
    assert_eq!(
        parse_earlier(&render_state(&state)),
        Some((state.counter, state.owner, state.expires_at_us))
    );
}

/// A state as this version writes it for a holder that gave an
/// identity (or none), with a record that needs encoding.
fn recorded(identity: Option<&str>) -> State {
    State {
        identity: identity.map(str::to_owned),
        holder: Some(HolderRecord {
            record: "1\tweb 3\t4121\t100% billing".into(),
            since_us: 1_699_999_970_000_000,
        }),
        ..held_as("")
    }
}

#[test]
fn state_round_trips_with_a_holder_record() {
    for identity in [None, Some("leader 1")] {
        let state = recorded(identity);
        let text = render_state(&state);
        assert_eq!(
            text.lines().count(),
            state.key.lines().count() + 5 + usize::from(identity.is_some()),
            "one line a field"
        );
        assert_eq!(parse_state(&text), Some(state), "{identity:?}");
    }
}

/// The parser of the version that added identities (before holder
/// records), verbatim but for the field it did not have.
fn parse_identity_era(text: &str) -> Option<State> {
    let mut lines = text.splitn(5, '\n');
    if lines.next()? != STATE_HEADER {
        return None;
    }
    let counter = lines.next()?.strip_prefix("counter ")?.parse().ok()?;
    let owner = match lines.next()?.strip_prefix("owner ")? {
        "-" => None,
        hex => Some(OwnerId::parse_hex(hex)?),
    };
    let expires_at_us = lines.next()?.strip_prefix("expires_us ")?.parse().ok()?;
    let mut fields = lines.next()?.split(FIELD_START);
    let key = fields.next()?.strip_prefix("key ")?.to_owned();
    let identity = fields
        .filter_map(|field| field.strip_prefix("identity ")?.split_once(' '))
        .find(|(by, _)| owner.is_some() && OwnerId::parse_hex(by) == owner)
        .and_then(|(_, encoded)| decode(encoded));
    Some(State {
        counter,
        owner,
        expires_at_us,
        key,
        identity,
        holder: None,
        queued: false,
        group: false,
        members: Vec::new(),
        marks: Vec::new(),
    })
}

#[test]
fn earlier_versions_read_a_state_with_a_holder_record() {
    for identity in [None, Some("leader\nof all")] {
        let state = recorded(identity);
        let text = render_state(&state);
        assert_eq!(
            parse_earlier(&text),
            Some((state.counter, state.owner, state.expires_at_us)),
            "the first version"
        );
        assert_eq!(
            parse_identity_era(&text),
            Some(State {
                holder: None,
                ..state
            }),
            "the version with identities reads its key and identity as before"
        );
    }
}

#[test]
fn a_state_an_earlier_version_wrote_parses_without_holder() {
    let owner = OwnerId::random().expect("random");
    let head = format!("{STATE_HEADER}\ncounter 12\nowner {owner}\nexpires_us 99\nkey k");
    let first = parse_state(&head).expect("the first version's state");
    assert_eq!((first.key.as_str(), first.holder), ("k", None));
    let with_identity = format!("{head}\n\0identity {owner} leader%201");
    let parsed = parse_state(&with_identity).expect("the identity version's state");
    assert_eq!(
        (
            parsed.key.as_str(),
            parsed.identity.as_deref(),
            parsed.holder
        ),
        ("k", Some("leader 1"), None)
    );
}

#[test]
fn a_holder_record_left_by_an_earlier_holder_is_not_the_current_ones() {
    // The first version, rewriting a state, keeps the holder line as
    // part of the key, under an owner (or none) that did not write it.
    let earlier = OwnerId::random().expect("random");
    let left = format!("\n\0holder {earlier} 5 1%09old%091%09");
    for owner in [OwnerId::random().ok(), None] {
        let owner_field = owner.map_or_else(|| "-".to_owned(), |o| o.to_string());
        let text =
            format!("{STATE_HEADER}\ncounter 12\nowner {owner_field}\nexpires_us 99\nkey k{left}");
        let parsed = parse_state(&text).expect("parses");
        assert_eq!((parsed.owner, parsed.holder), (owner, None));
    }
    let text = format!("{STATE_HEADER}\ncounter 12\nowner {earlier}\nexpires_us 99\nkey k{left}");
    let parsed = parse_state(&text).expect("parses");
    assert_eq!(
        parsed.holder,
        Some(HolderRecord {
            record: "1\told\t1\t".into(),
            since_us: 5
        }),
        "its own"
    );
}

#[test]
fn an_unreadable_holder_record_is_no_holder_not_a_corrupt_state() {
    let owner = OwnerId::random().expect("random");
    let head = format!("{STATE_HEADER}\ncounter 12\nowner {owner}\nexpires_us 99\nkey k");
    for line in [
        "holder",
        "holder x",
        &format!("holder {owner}"),
        &format!("holder {owner} 12"),
        &format!("holder {owner} soon 1%09h%091%09"),
        &format!("holder {owner} -5 1%09h%091%09"),
        &format!("holder {owner} 12 1%0"),
        &format!("holder {owner} 12 1%09h%091%09 more"),
    ] {
        let parsed = parse_state(&format!("{head}\n\0{line}")).expect("the counter is read");
        assert_eq!((parsed.counter, parsed.holder), (12, None), "{line:?}");
    }
    let later = format!("{head}\n\0mode shared\n\0holder {owner} 7 rec");
    assert_eq!(
        parse_state(&later).expect("parses").holder,
        Some(HolderRecord {
            record: "rec".into(),
            since_us: 7
        })
    );
}

#[test]
fn an_identity_left_by_an_earlier_holder_is_not_the_current_ones() {
    // An earlier version that rewrites a state keeps the identity line
    // as part of the key: a forced release, then its own acquisition's
    // retry, leave it under an owner (or none) that did not record it.
    let earlier = OwnerId::random().expect("random");
    let left = format!("\n\0identity {earlier} old-leader");
    for owner in [OwnerId::random().ok(), None] {
        let owner_field = owner.map_or_else(|| "-".to_owned(), |o| o.to_string());
        let text =
            format!("{STATE_HEADER}\ncounter 12\nowner {owner_field}\nexpires_us 99\nkey k{left}");
        let parsed = parse_state(&text).expect("parses");
        assert_eq!((parsed.owner, parsed.identity), (owner, None));
    }
    let text = format!("{STATE_HEADER}\ncounter 12\nowner {earlier}\nexpires_us 99\nkey k{left}");
    let parsed = parse_state(&text).expect("parses");
    assert_eq!(parsed.identity.as_deref(), Some("old-leader"), "its own");
}

#[test]
fn an_unreadable_identity_is_no_identity_not_a_corrupt_state() {
    let owner = OwnerId::random().expect("random");
    let head = format!("{STATE_HEADER}\ncounter 12\nowner {owner}\nexpires_us 99\nkey k");
    for line in [
        "identity",
        "identity x",
        &format!("identity {owner} %4"),
        &format!("identity {owner} %zz"),
    ] {
        let parsed = parse_state(&format!("{head}\n\0{line}")).expect("the counter is read");
        assert_eq!((parsed.counter, parsed.identity), (12, None), "{line:?}");
    }
    let later = format!("{head}\n\0mode shared\n\0identity {owner} me");
    assert_eq!(
        parse_state(&later).expect("parses").identity.as_deref(),
        Some("me")
    );
}

#[test]
fn the_queued_field_round_trips_and_earlier_versions_read_past_it() {
    for identity in [None, Some("leader 1")] {
        let state = State {
            queued: true,
            ..recorded(identity)
        };
        let text = render_state(&state);
        assert_eq!(parse_state(&text), Some(state.clone()), "{identity:?}");
        assert_eq!(
            parse_earlier(&text),
            Some((state.counter, state.owner, state.expires_at_us)),
            "the first version"
        );
        assert_eq!(
            parse_identity_era(&text),
            Some(State {
                holder: None,
                queued: false,
                ..state.clone()
            }),
            "the version with identities"
        );
        // The version with holder records read fields as this one does,
        // without `queued`: it skips the line and reads the rest.
        let without = text.replace("\n\0queued", "");
        assert_eq!(
            parse_state(&without),
            Some(State {
                queued: false,
                ..state
            })
        );
    }
    let free = State {
        counter: 3,
        key: "k".into(),
        queued: true,
        ..State::default()
    };
    assert_eq!(parse_state(&render_state(&free)), Some(free), "a free key");
}

/// A state a group of two readers and a mark hold, as this version
/// writes it.
fn group_state(slot: Option<u32>) -> State {
    let member = |token, expires_at_us| Member {
        owner: OwnerId::random().expect("random"),
        slot,
        token,
        expires_at_us,
        since_us: 5,
        record: "1\tweb 3\t4121\t100% billing".into(),
    };
    State {
        counter: 40,
        owner: OwnerId::random().ok(),
        expires_at_us: 1_700_000_009_000_000,
        key: "a\nkey".into(),
        group: true,
        members: vec![
            member(40, 1_700_000_009_000_000),
            member(40, 1_700_000_008_000_000),
        ],
        marks: vec![(OwnerId::random().expect("random"), 1_700_000_003_000_000)],
        ..State::default()
    }
}

#[test]
fn a_group_state_round_trips_and_every_earlier_version_sees_the_key_held() {
    for slot in [None, Some(3)] {
        let state = group_state(slot);
        let text = render_state(&state);
        assert_eq!(parse_state(&text), Some(state.clone()), "{slot:?}");
        // Each earlier version reads the group as the owner, held
        // until the latest member's expiry: never a free key.
        assert_eq!(
            parse_earlier(&text),
            Some((state.counter, state.owner, state.expires_at_us)),
            "the first version"
        );
        let identity_era = parse_identity_era(&text).expect("parses");
        assert_eq!(
            (identity_era.owner, identity_era.expires_at_us),
            (state.owner, state.expires_at_us),
            "the version with identities"
        );
        assert_eq!(identity_era.key, state.key);
        let without = text
            .split(FIELD_START)
            .filter(|field| !field.starts_with("group"))
            .collect::<Vec<_>>()
            .join(FIELD_START);
        // A `group` field lost (no later writer drops it, but an
        // unknown line is no member): the members are not read as
        // holders of anything, the owner is the holder.
        let lost = parse_state(&without).expect("parses");
        assert_eq!((lost.owner, lost.members.len()), (state.owner, 0));
    }
}

#[test]
fn unreadable_member_and_mark_lines_are_none_not_a_corrupt_state() {
    let state = group_state(None);
    let head = render_state(&State {
        members: Vec::new(),
        marks: Vec::new(),
        ..state.clone()
    });
    let owner = OwnerId::random().expect("random");
    for line in [
        "reader".to_owned(),
        format!("reader {owner}"),
        format!("reader {owner} 1 2 3"),
        format!("reader {owner} 1 2 3 rec"),
        format!("reader {owner} x 2 3 +rec"),
        format!("reader {owner} 1 2 3 +%zz"),
        format!("reader {owner} 1 2 3 +rec more"),
        format!("permit x {owner} 1 2 3 +rec"),
        format!("permit -1 {owner} 1 2 3 +rec"),
        "mark".to_owned(),
        format!("mark {owner}"),
        format!("mark {owner} soon"),
    ] {
        let parsed = parse_state(&format!("{head}{FIELD_START}{line}")).expect("parses");
        assert_eq!(
            (parsed.counter, parsed.members.len(), parsed.marks.len()),
            (40, 0, 0),
            "{line:?}"
        );
    }
}

fn waiter(identity: Option<&str>, record: &str) -> Waiter {
    Waiter {
        owner: OwnerId::random().expect("random"),
        ttl_us: 30_000_001,
        expires_at_us: 1_700_000_003_000_000,
        record: record.into(),
        identity: identity.map(str::to_owned),
    }
}

#[test]
fn a_queue_round_trips_in_order_with_odd_identities_and_records() {
    let waiters = vec![
        waiter(None, "1\tweb 3\t4121\t100% billing"),
        waiter(Some(""), ""),
        waiter(Some("line\nbreak + - %41"), "-"),
        waiter(Some("-"), "+"),
    ];
    let text = render_queue(&waiters);
    assert_eq!(text.lines().count(), waiters.len() + 1, "one line a waiter");
    assert_eq!(parse_queue(&text), waiters);
    assert_eq!(render_queue(&[]), QUEUE_HEADER);
    assert_eq!(parse_queue(QUEUE_HEADER), Vec::new());
}

#[test]
fn unreadable_queue_lines_are_no_entries_and_a_file_that_is_no_queue_holds_none() {
    let kept = waiter(Some("kept"), "1\th\t1\t");
    let line = render_queue(std::slice::from_ref(&kept));
    let line = line.lines().nth(1).expect("the entry");
    let owner = OwnerId::random().expect("random");
    let text = [
        QUEUE_HEADER,
        "",
        "garbage",
        &format!("{owner} 1 2 +rec"),
        &format!("{owner} 1 2 rec -"),
        &format!("{owner} x 2 +rec -"),
        &format!("{owner} 1 2 +rec - more"),
        &format!("{owner} 1 2 +%zz -"),
        line,
        // A crash mid-write: the last line cut short.
        &line[..line.len() / 2],
    ]
    .join("\n");
    assert_eq!(parse_queue(&text), vec![kept]);
    assert_eq!(parse_queue(&format!("not a queue\n{line}")), Vec::new());
    assert_eq!(parse_queue(""), Vec::new());
}

#[test]
fn corrupt_state_is_not_parsed() {
    assert_eq!(parse_state("garbage"), None);
    assert_eq!(parse_state(&format!("{STATE_HEADER}\ncounter x\n")), None);
}

#[test]
fn file_names_are_distinct_and_bounded() {
    let name = |k: &str| file_name(&LockKey::new(k).expect("valid key"));
    assert_ne!(name("a:b"), name("a%3Ab"));
    assert_ne!(name("a.b"), name("a_b"));
    assert!(!name("x.y/../z").contains(['.', '/']));
    let long = "k".repeat(1000);
    assert!(name(&long).len() <= MAX_PLAIN_NAME);
    assert_ne!(name(&long), name(&"k".repeat(999)));
}
