use super::*;
use tokio::time::advance;

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// A pace measured at `rate` bytes a second: one window of that much work.
async fn measured(rate: u64) -> Pace {
    let pace = Pace::default();
    let t = pace.start(rate, Instant::now());
    advance(WINDOW).await;
    assert_eq!(t.done(), Some(rate as f64));
    pace
}

#[tokio::test(start_paused = true)]
async fn before_a_window_of_work_closes_the_pace_is_unknown_and_all_is_admitted() {
    let pace = Pace::default();
    let t = pace.start(10_000, Instant::now());
    let now = Instant::now();
    assert_eq!(pace.admits(10_000, Some(now + secs(0.001)), now), Ok(()));
    advance(secs(0.5)).await;
    assert_eq!(t.done(), None, "half a window is no sample");
    let _ahead = pace.start(10_000, Instant::now());
    assert_eq!(pace.admits(10_000, Some(now + secs(0.001)), now), Ok(()));
}

#[tokio::test(start_paused = true)]
async fn work_that_cannot_finish_before_its_deadline_is_refused() {
    let pace = measured(1000).await;
    let _ahead = pace.start(1000, Instant::now());
    let now = Instant::now();
    // 1000 bytes ahead and 1000 of its own take 2 s at 1000 bytes/s, 2 s * MARGIN with the
    // margin.
    let short_of = secs(2.0 * MARGIN - 0.01);
    let refused = pace.admits(1000, Some(now + short_of), now).unwrap_err();
    assert_eq!(refused.estimate, secs(2.0));
    assert_eq!((refused.ahead, refused.rate), (1000, 1000.0));
    assert_eq!(refused.left, short_of);
    assert_eq!(
        pace.admits(1000, Some(now + secs(2.0 * MARGIN + 1e-6)), now),
        Ok(())
    );
    // Shorter work fits where longer did not: bytes, not a count of requests.
    assert_eq!(pace.admits(100, Some(now + short_of), now), Ok(()));
    assert_eq!(
        pace.admits(1000, None, now),
        Ok(()),
        "no deadline, no refusal"
    );
}

#[tokio::test(start_paused = true)]
async fn work_too_long_for_its_deadline_alone_is_refused_unless_it_probes_a_quiet_evaluator() {
    let pace = measured(1000).await;
    // Work that started (and failed) just now: the evaluator is idle again, but not quiet.
    drop(pace.start(100, Instant::now()));
    let now = Instant::now();
    // Nothing is ahead, but its own 5 s of work would miss a 1 s deadline.
    let refused = pace.admits(5000, Some(now + secs(1.0)), now).unwrap_err();
    assert_eq!((refused.ahead, refused.estimate), (0, secs(5.0)));
    assert_eq!(pace.admits(500, Some(now + secs(1.0)), now), Ok(()));
    // Given nothing for PROBE_AFTER, an idle evaluator takes it: a pace that drifted low must
    // still get work to measure it again.
    advance(PROBE_AFTER - secs(0.1)).await;
    assert!(
        pace.admits(5000, Some(Instant::now() + secs(1.0)), Instant::now())
            .is_err()
    );
    advance(secs(0.1)).await;
    let now = Instant::now();
    let probe = pace.admit_one(5000, Some(now + secs(1.0)), now).unwrap();
    // Not while the probe runs, nor right after it.
    assert!(pace.admits(5000, Some(now + secs(1.0)), now).is_err());
    drop(probe);
    assert!(pace.admits(5000, Some(now + secs(1.0)), now).is_err());
}

#[tokio::test(start_paused = true)]
async fn the_pace_counts_answered_work_over_busy_time_only() {
    let pace = Pace::default();
    let failed = pace.start(500, Instant::now());
    let answered = pace.start(500, Instant::now());
    advance(secs(0.5)).await;
    drop(failed);
    advance(secs(0.5)).await;
    // 500 bytes answered in 1 s busy: the failed request's bytes are not cleared work.
    assert_eq!(answered.done(), Some(500.0));
    // Idle time between requests is not busy time: 1000 bytes in two busy half-seconds.
    let pace = Pace::default();
    let a = pace.start(500, Instant::now());
    advance(secs(0.5)).await;
    assert_eq!(a.done(), None);
    advance(secs(10.0)).await;
    let b = pace.start(500, Instant::now());
    advance(secs(0.5)).await;
    assert_eq!(b.done(), Some(1000.0));
}

#[tokio::test(start_paused = true)]
async fn a_new_sample_moves_the_pace_by_its_weight() {
    let pace = measured(1000).await;
    let t = pace.start(2000, Instant::now());
    advance(WINDOW).await;
    let rate = t.done().unwrap();
    assert!((rate - (1000.0 + ALPHA * 1000.0)).abs() < 1e-9, "{rate}");
}

#[tokio::test(start_paused = true)]
async fn work_the_evaluator_has_been_serving_counts_as_partly_done() {
    let pace = measured(1000).await;
    let mut serving = pace.start(1000, Instant::now());
    serving.serving();
    let _queued = pace.start(1000, Instant::now());
    advance(secs(0.5)).await;
    let now = Instant::now();
    // Half a second at 1000 bytes/s into the served request: 500 + 1000 queued are ahead.
    let refused = pace.admits(1000, Some(now + secs(3.0)), now).unwrap_err();
    assert_eq!(refused.ahead, 1500);
    assert_eq!(
        pace.admits(1000, Some(now + secs(2.5 * MARGIN + 1e-6)), now),
        Ok(())
    );
    // Never more credit than the served work: 5 s on it leaves the queued request ahead.
    advance(secs(4.5)).await;
    let now = Instant::now();
    let refused = pace.admits(1000, Some(now + secs(2.0)), now).unwrap_err();
    assert_eq!(refused.ahead, 1000);
}

#[tokio::test(start_paused = true)]
async fn what_is_admitted_is_ahead_of_the_next_admission_and_a_refusal_counts_nothing() {
    let pace = measured(1000).await;
    let _ahead = pace.start(500, Instant::now());
    let now = Instant::now();
    // 500 ahead plus 700 and 300 of its own take 1.5 s: they fit a deadline that far, with
    // the margin.
    let deadline = Some(now + secs(1.5 * MARGIN + 1e-6));
    let batch = pace.admit(&[700, 300], deadline, now).unwrap();
    assert_eq!(batch.len(), 2);
    // Now 1500 bytes are ahead: the same 1000 bytes no longer fit the same deadline.
    let refused = pace.admit_one(1000, deadline, now).unwrap_err();
    assert_eq!(refused.ahead, 1500);
    assert!(pace.admit(&[700, 300], deadline, now).is_err());
    // The refusals took no room: with the batch gone, 1000 bytes fit again.
    drop(batch);
    assert!(pace.admit_one(1000, deadline, now).is_ok());
}

#[tokio::test(start_paused = true)]
async fn under_load_a_request_ends_with_the_batch_mates_that_follow_it() {
    // Two served at once; a window of 1000-byte requests sets the pace and the mean request.
    let pace = Pace::new(2, Sharing::Batched);
    let t = pace.start(1000, Instant::now());
    advance(WINDOW).await;
    assert_eq!(t.done(), Some(1000.0));
    let now = Instant::now();
    // Idle but measured: its own 1000 bytes, 1 s, fit with the margin.
    assert_eq!(
        pace.admits(1000, Some(now + secs(MARGIN + 1e-6)), now),
        Ok(())
    );
    // With one request pending, one mate of the mean size likely shares its batch: 1000 ahead,
    // 1000 beside and 1000 its own take 3 s, 3 s * MARGIN with the margin.
    let _ahead = pace.start(1000, now);
    let refused = pace
        .admits(1000, Some(now + secs(3.0 * MARGIN - 0.01)), now)
        .unwrap_err();
    assert_eq!((refused.ahead, refused.beside), (1000, 1000));
    assert_eq!(refused.estimate, secs(3.0));
    assert_eq!(
        pace.admits(1000, Some(now + secs(3.0 * MARGIN + 1e-6)), now),
        Ok(())
    );
    // Serving one at a time, nothing shares its batch.
    let alone = Pace::default();
    let t = alone.start(1000, Instant::now());
    advance(WINDOW).await;
    t.done();
    let now = Instant::now();
    let _ahead = alone.start(1000, now);
    let refused = alone
        .admits(1000, Some(now + secs(2.0 * MARGIN - 0.01)), now)
        .unwrap_err();
    assert_eq!((refused.ahead, refused.beside), (1000, 0));
}

/// 5 s of work against a 1 s deadline, at a pace of 1000 bytes a second: admitted only as a
/// probe.
fn too_long(pace: &Pace) -> Result<Ticket<'_>, TooSlow> {
    let now = Instant::now();
    pace.admit_one(5000, Some(now + secs(1.0)), now)
}

#[tokio::test(start_paused = true)]
async fn probes_that_end_unanswered_back_off_and_an_answer_resets_them() {
    let pace = measured(1000).await;
    // A machine slowed past the deadlines: 5 s of work against 1 s deadlines, a request a
    // second. Each probe ends unanswered and doubles the quiet time the next one needs.
    advance(PROBE_AFTER).await;
    drop(too_long(&pace).unwrap());
    advance(PROBE_AFTER).await;
    assert!(too_long(&pace).is_err(), "the next probe waits 2 s");
    advance(PROBE_AFTER).await;
    drop(too_long(&pace).unwrap());
    for waited in 1..4 {
        advance(PROBE_AFTER).await;
        assert!(
            too_long(&pace).is_err(),
            "{waited} s of the 4 s the next probe waits"
        );
    }
    advance(PROBE_AFTER).await;
    let probe = too_long(&pace).unwrap();
    // An answer resets the wait: 6 s after that probe started is enough again (8 s was due).
    advance(secs(5.0)).await;
    let _ = probe.done();
    advance(PROBE_AFTER).await;
    assert!(too_long(&pace).is_ok());
}

#[tokio::test(start_paused = true)]
async fn in_parallel_the_pace_is_one_requests_own_and_waits_only_past_the_slots() {
    // Eight 1000-byte requests served side by side for 1 s each: the upstream clears 8000
    // bytes a busy second, but a request's own pace is 1000 bytes a second.
    let pace = Pace::new(8, Sharing::Parallel);
    let tickets: Vec<_> = (0..8)
        .map(|_| {
            let mut t = pace.start(1000, Instant::now());
            t.serving();
            t
        })
        .collect();
    advance(WINDOW).await;
    let rates: Vec<_> = tickets.into_iter().map(Ticket::done).collect();
    assert_eq!(rates.last(), Some(&Some(1000.0)), "{rates:?}");
    // Seven pending, a slot free: nothing ahead, its own 1 s fits 1.3 s.
    let now = Instant::now();
    let _pending: Vec<_> = (0..7).map(|_| pace.start(1000, now)).collect();
    assert_eq!(
        pace.admits(1000, Some(now + secs(MARGIN + 1e-6)), now),
        Ok(())
    );
    // Sixteen pending over eight slots: two requests' worth ahead of it.
    let _more: Vec<_> = (0..9).map(|_| pace.start(1000, now)).collect();
    let refused = pace.admits(1000, Some(now + secs(2.0)), now).unwrap_err();
    assert_eq!((refused.ahead, refused.beside), (2000, 0));
    assert_eq!(refused.estimate, secs(3.0));
    assert_eq!(refused.retry_after, secs(3.0 * MARGIN - 2.0));
    assert_eq!(pace.drain(now), Some(secs(2.0)));
}

#[tokio::test(start_paused = true)]
async fn a_probe_refused_as_bad_input_is_no_unanswered_probe() {
    // A burst of bad input on a slowed machine: each probe the caller got wrong must not
    // double the quiet time a real probe waits for (it says nothing of the evaluator).
    let pace = measured(1000).await;
    for _ in 0..3 {
        advance(PROBE_AFTER).await;
        too_long(&pace).unwrap().bad_input();
    }
    advance(PROBE_AFTER).await;
    assert!(
        too_long(&pace).is_ok(),
        "the next probe waits only PROBE_AFTER"
    );
    // A probe that goes unanswered still backs off.
    let pace = measured(1000).await;
    advance(PROBE_AFTER).await;
    drop(too_long(&pace).unwrap());
    advance(PROBE_AFTER).await;
    assert!(too_long(&pace).is_err());
}
