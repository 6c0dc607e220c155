//! Expiry and renewal: a lease kept for its whole ttl and no longer,
//! renewed past several ttls, and its holder told when it is lost.

use super::*;

/// A lease that is not renewed expires: the key is free after its ttl, and
/// not before it, with a higher token for the next holder.
pub async fn expiry_frees_the_key(backend: Arc<dyn Backend>) {
    // A store that kept the lease for less (half, say) frees the key a
    // second early: a waiter retrying within that second tells.
    const TTL: Duration = Duration::from_millis(2_000);
    let key = fresh_key("expiry");
    // Before the request leaves: the lease cannot start earlier, so the
    // key must stay held until at least a ttl after this, however late the
    // waiter below gets it on a loaded machine.
    let asked = Instant::now();
    let holder = options(TTL.as_millis() as u64)
        .renew(false)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let next = take(
        &backend,
        &key,
        10_000,
        Duration::from_secs(10),
        "the key must be free once the holder's ttl ran out",
    )
    .await;
    let freed_after = asked.elapsed();
    assert!(
        freed_after + ROUNDING >= TTL,
        "the key was taken again {freed_after:?} after a lease of {TTL:?} was asked for: \
         a store must keep a lease for its whole ttl"
    );
    assert!(next.token() > holder.token());
    assert!(
        holder.is_lost(),
        "the expired holder must know it lost the lease"
    );
    assert!(matches!(
        holder.release().await,
        Err(LockError::LeaseLost { .. })
    ));
    assert!(
        next.check().is_ok(),
        "the expired holder's release must not touch the new lease"
    );
    next.release().await.expect("release");
}

/// `extend` sets the lease's remaining lifetime, shorter as well as longer:
/// a release within a minimum hold cuts the lease to what is left of the
/// hold, and the key must be free when that runs out, not at the old
/// deadline.
pub async fn an_extend_to_a_shorter_ttl_frees_the_key_at_the_new_deadline(
    backend: Arc<dyn Backend>,
) {
    use crate::backend::{Attempt, Renewal};
    let key = fresh_key("shortened");
    let owner = OwnerId::random().expect("random");
    let taken = attempt_as(&backend, &key, &owner, Duration::from_secs(20)).await;
    assert!(
        matches!(taken, Attempt::Acquired(_)),
        "a fresh key must be free"
    );
    let shortened = backend
        .extend(&Renewal::new(&key, &owner, Duration::from_millis(300)))
        .await
        .expect("backend answers");
    assert!(shortened, "the holder's extend must be accepted");
    // Far sooner than the old 20 s deadline, with room for a slow machine.
    free_within(
        &backend,
        &key,
        10_000,
        Duration::from_secs(8),
        "the key must be free once the shortened lease ran out",
    )
    .await;
}

/// A renewed lease outlives several ttls and stays exclusive.
pub async fn renewal_keeps_a_lease_alive_past_several_ttls(backend: Arc<dyn Backend>) {
    let key = fresh_key("renewal");
    // A ttl of 2 s is renewed every third of it: a renewal delayed by a
    // stall of up to ~1.3 s on a busy machine still lands in time.
    let asked = Instant::now();
    let lease = take(&backend, &key, 2_000, Duration::ZERO, "free").await;
    // Counted from the request, so a slow acquisition cannot eat into the
    // span the lease must outlive by renewal.
    tokio::time::sleep_until(asked + Duration::from_millis(7_000)).await;
    assert!(
        lease.check().is_ok(),
        "a renewed lease must survive 3.5 ttls"
    );
    let contender = options(1_000).acquire_on(backend.clone(), &key).await;
    assert!(matches!(contender, Err(LockError::Held { .. })));
    lease.release().await.expect("release");
}

/// The lost signal fires when an administrator breaks the lock (`force_release`).
pub async fn lost_signal_fires_when_the_lease_is_taken_away(backend: Arc<dyn Backend>) {
    let key = fresh_key("taken-away");
    // A ttl long enough that the lease cannot run out by itself first: a
    // renewal comes every third of it, so a stall of up to ~2 s on a busy
    // machine still keeps it, and the loss it reports is the break. (At
    // 300 ms a stall of 200 ms lost it to its ttl, and the test read that
    // as the wrong signal.)
    let lease = take(&backend, &key, 3_000, Duration::ZERO, "free").await;
    assert!(backend.force_release(&key).await.expect("force release"));
    let usurper = take(&backend, &key, 10_000, Duration::ZERO, "freed").await;
    let lost = within(10, "the lost signal", lease.lost()).await;
    assert!(
        matches!(
            lost,
            LockError::LeaseLost {
                // A store that can only break a lock by ending the holder's
                // session (PostgreSQL) reports that instead.
                reason: LostReason::NotOwner | LostReason::SessionEnded(_),
                ..
            }
        ),
        "unexpected: {lost}"
    );
    assert!(matches!(
        lease.release().await,
        Err(LockError::LeaseLost { .. })
    ));
    assert!(usurper.check().is_ok());
    let third = options(10_000).acquire_on(backend.clone(), &key).await;
    assert!(
        matches!(third, Err(LockError::Held { .. })),
        "the lost holder's release must not free the usurper's lock"
    );
    usurper.release().await.expect("release");
}

/// The lost signal fires when the ttl runs out without renewal.
pub async fn lost_signal_fires_when_the_ttl_runs_out_without_renewal(backend: Arc<dyn Backend>) {
    let key = fresh_key("ttl-runs-out");
    let lease = options(200)
        .renew(false)
        .acquire_on(backend.clone(), &key)
        .await
        .expect("free");
    let signal = lease.lost_signal();
    let lost = within(10, "the lost signal", signal.lost()).await;
    assert!(
        matches!(
            lost,
            LockError::LeaseLost {
                reason: LostReason::Expired,
                ..
            }
        ),
        "unexpected: {lost}"
    );
    assert!(lease.check().is_err());
}
