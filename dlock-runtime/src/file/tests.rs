//! Unit tests of the file backend's state, identity and holder records.

use super::*;

fn unit_dir() -> PathBuf {
    std::env::temp_dir().join(format!(
        "dlock-file-unit-{}",
        OwnerId::random().expect("random")
    ))
}

#[test]
fn a_ttl_with_a_fraction_of_a_microsecond_is_rounded_up_in_the_state() {
    let dir = std::env::temp_dir().join(format!(
        "dlock-file-unit-{}",
        OwnerId::random().expect("random")
    ));
    let backend = FileBackend::open(&dir).expect("dir");
    let owner = OwnerId::random().expect("random");
    let ttl = Duration::from_secs(10) + Duration::from_nanos(500);
    let attempt = backend
        .inner
        .try_acquire("k", "k", owner, ttl, None, "", Queue::Barge, false);
    assert!(matches!(attempt, Ok(Attempt::Acquired(_))), "{attempt:?}");
    let state = backend.inner.read_state("k").expect("readable");
    let _ = fs::remove_dir_all(&dir);
    // A new key's counter starts at the clock reading the expiry is
    // counted from, so the difference is the stored ttl exactly.
    let state = state.expect("written");
    assert_eq!(state.expires_at_us - (state.counter - 1), 10_000_001);
}

#[test]
fn the_identity_is_written_with_the_owner_rewritten_by_a_retry_and_cleared_on_release() {
    let dir = std::env::temp_dir().join(format!(
        "dlock-file-unit-{}",
        OwnerId::random().expect("random")
    ));
    let backend = FileBackend::open(&dir).expect("dir");
    let inner = &backend.inner;
    let (owner, ttl) = (OwnerId::random().expect("random"), Duration::from_secs(10));
    let token = |attempt: io::Result<Attempt>| match attempt {
        Ok(Attempt::Acquired(grant)) => grant.token,
        other => panic!("not acquired: {other:?}"),
    };
    let identity = || {
        let state = inner.read_state("k").expect("readable").expect("written");
        state.identity
    };
    let first = token(inner.try_acquire(
        "k",
        "k",
        owner,
        ttl,
        Some("a b\n%"),
        "",
        Queue::Barge,
        false,
    ));
    assert_eq!(identity().as_deref(), Some("a b\n%"));
    let retried =
        token(inner.try_acquire("k", "k", owner, ttl, Some("again"), "", Queue::Barge, false));
    assert_eq!(retried, first, "a retry keeps its token");
    assert_eq!(identity().as_deref(), Some("again"));
    let holding = inner.holder("k").expect("readable").expect("held");
    assert_eq!(
        (holding.token, holding.identity.as_deref()),
        (Some(first), Some("again"))
    );
    assert!(inner.release("k", owner).expect("released"));
    assert_eq!(identity(), None, "a release clears it");
    assert_eq!(inner.holder("k").expect("readable"), None);
    let other = OwnerId::random().expect("random");
    let next = token(inner.try_acquire("k", "k", other, ttl, None, "", Queue::Barge, false));
    assert!(next > first);
    let holding = inner.holder("k").expect("readable").expect("held");
    assert_eq!((holding.token, holding.identity), (Some(next), None));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn the_holder_record_is_written_with_the_key_kept_by_a_retry_and_cleared_on_release() {
    let dir = unit_dir();
    let backend = FileBackend::open(&dir).expect("dir");
    let inner = &backend.inner;
    let (owner, ttl) = (OwnerId::random().expect("random"), Duration::from_secs(10));
    let me = HolderInfo::this_process(Some("unit"));
    let recorded = || {
        inner
            .read_state("k")
            .expect("readable")
            .expect("written")
            .holder
    };
    let before = now_us();
    let first = inner.try_acquire(
        "k",
        "k",
        owner,
        ttl,
        None,
        &me.encode(),
        Queue::Barge,
        false,
    );
    assert!(matches!(first, Ok(Attempt::Acquired(_))), "{first:?}");
    let written = recorded().expect("every acquisition records its holder");
    assert_eq!(written.record, me.encode());
    assert!(written.since_us >= before && written.since_us <= now_us());
    let retried = inner.try_acquire(
        "k",
        "k",
        owner,
        ttl,
        None,
        "1\tother\t1\t",
        Queue::Barge,
        false,
    );
    assert!(matches!(retried, Ok(Attempt::Acquired(_))), "{retried:?}");
    assert_eq!(recorded(), Some(written), "a retry is the same acquisition");
    assert!(inner.extend("k", owner, ttl).expect("extend"));
    let holding = inner.holder("k").expect("readable").expect("held");
    let holder = holding.holder.expect("recorded");
    assert_eq!(
        (holder.host, holder.pid, holder.label),
        (me.host, me.pid, me.label)
    );
    assert!(inner.release("k", owner).expect("released"));
    assert_eq!(recorded(), None, "a release clears it");
    let other = OwnerId::random().expect("random");
    let next = inner.try_acquire("k", "k", other, ttl, None, "1\th\t2\t", Queue::Barge, false);
    assert!(matches!(next, Ok(Attempt::Acquired(_))), "{next:?}");
    assert!(inner.force_release("k").expect("forced"));
    assert_eq!(recorded(), None, "a forced release clears it");
    let _ = fs::remove_dir_all(&dir);
}

fn granted(attempt: io::Result<Attempt>) -> Grant {
    match attempt {
        Ok(Attempt::Acquired(grant)) => grant,
        other => panic!("not acquired: {other:?}"),
    }
}

#[test]
fn an_earlier_version_probing_a_read_phase_finds_it_held_until_the_last_reader_leaves() {
    let dir = unit_dir();
    let backend = FileBackend::open(&dir).expect("dir");
    // Another process's view: no alive file of its own.
    let other = FileBackend::open(&dir).expect("dir");
    let inner = &backend.inner;
    let ttl = Duration::from_secs(10);
    let readers = [OwnerId::random(), OwnerId::random()].map(|o| o.expect("random"));
    let tokens = readers
        .map(|reader| granted(inner.join_group("k", "k", reader, ttl, "", Access::Shared)).token);
    assert_eq!(tokens[0], tokens[1], "one phase");
    let state = inner.read_state("k").expect("readable").expect("written");
    let group = state.owner.expect("the group is the owner");
    assert!(state.group && state.expires_at_us > now_us());
    for reader in readers {
        // What an earlier version does with the owner it reads: probe
        // its alive file, which every reader holds locked shared.
        assert!(other.inner.holder_alive("k", &group, false).expect("probe"));
        assert!(
            inner
                .release_as("k", reader, Access::Shared, None)
                .expect("released")
        );
    }
    let state = inner.read_state("k").expect("readable").expect("written");
    assert_eq!(
        (state.owner, state.group),
        (None, false),
        "free to every version"
    );
    assert!(
        !inner.alive_path("k", &group).exists(),
        "the group's file goes"
    );
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_permit_holder_whose_process_died_frees_its_slot_at_the_next_attempt() {
    let dir = unit_dir();
    let backend = FileBackend::open(&dir).expect("dir");
    let inner = &backend.inner;
    let (ttl, one) = (Duration::from_secs(10), Access::Permits { permits: 1 });
    let dead = OwnerId::random().expect("random");
    let first = granted(inner.join_group("k", "k", dead, ttl, "", one));
    assert_eq!(first.slot, Some(0));
    let next = OwnerId::random().expect("random");
    let refused = inner.join_group("k", "k", next, ttl, "", one);
    assert!(matches!(refused, Ok(Attempt::Held { .. })), "{refused:?}");
    // As if its process died: its descriptors close, its files stay.
    inner
        .alive
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(&("k".to_owned(), dead));
    let taken = granted(inner.join_group("k", "k", next, ttl, "", one));
    assert_eq!(taken.slot, Some(0));
    assert!(taken.token > first.token);
    assert!(
        !inner.alive_path("k", &dead).exists(),
        "the dead one's file goes"
    );
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_clock_stepped_back_since_the_acquisition_reads_as_no_time_held() {
    let dir = unit_dir();
    let backend = FileBackend::open(&dir).expect("dir");
    let inner = &backend.inner;
    let (owner, ttl) = (OwnerId::random().expect("random"), Duration::from_secs(10));
    let record = HolderInfo::this_process(None).encode();
    let taken = inner.try_acquire("k", "k", owner, ttl, None, &record, Queue::Barge, false);
    assert!(matches!(taken, Ok(Attempt::Acquired(_))), "{taken:?}");
    let mut state = inner.read_state("k").expect("readable").expect("written");
    if let Some(holder) = &mut state.holder {
        // As if the clock read an hour later when the key was taken.
        holder.since_us += 3_600_000_000;
    }
    inner.write_state("k", &state, false).expect("rewrite");
    let holding = inner.holder("k").expect("readable").expect("held");
    assert_eq!(
        holding.holder.and_then(|holder| holder.held_for),
        Some(Duration::ZERO)
    );
    let _ = fs::remove_dir_all(&dir);
}
