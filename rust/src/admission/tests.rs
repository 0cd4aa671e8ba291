//! Tests of the admission controller (unit, property, shared memory, ignored benchmarks).

#![allow(clippy::many_single_char_names)] // a: admission, b: backend, t: tenant, r: refusal

use super::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::region::Capacity;
use crate::clock::ManualClock;
use crate::error::MAX_AMOUNT;

fn setup() -> (Arc<Admission>, Arc<ManualClock>, u32) {
    setup_in(Rmw::Atomic)
}

/// A controller in mode `rmw` on a manual clock with one backend: 4 slots, 6,000 TPM,
/// 1,000 in-flight tokens.
fn setup_in(rmw: Rmw) -> (Arc<Admission>, Arc<ManualClock>, u32) {
    let mc = Arc::new(ManualClock::new(0));
    let clock = Clock::Manual(mc.clone());
    let a = match rmw {
        Rmw::Atomic => Admission::new_heap(clock),
        Rmw::Serialized => Admission::new_heap_serialized(clock),
    }
    .unwrap();
    let b = a
        .add_backend(
            "b0",
            &BackendConfig {
                max_concurrency: 4,
                tokens_per_minute: 6000,
                burst_tokens: None,
                inflight_token_limit: Some(1000),
            },
        )
        .unwrap();
    (a, mc, b)
}

fn tenant(a: &Admission, name: &str, p: Priority, g: u64, tpm: Option<u64>) -> u32 {
    a.add_tenant(
        name,
        &TenantConfig {
            priority: p,
            tokens_per_minute: tpm,
            burst_tokens: None,
            max_concurrency: None,
            guaranteed_slots: g,
            guaranteed_backends: ALL_BACKENDS,
        },
    )
    .unwrap()
}

/// `(controller, its clock, backend id, [(tenant id, its priority); 3])`.
type ModelController = (Arc<Admission>, Arc<ManualClock>, u32, [(u32, Priority); 3]);

/// [`setup_in`]'s controller with three tenants: critical with 2 guaranteed slots and
/// 3,000 TPM, standard limited to 3 at once, sheddable.
fn model_controller(rmw: Rmw) -> ModelController {
    let (a, mc, b) = setup_in(rmw);
    let mut tenants = [(0, Priority::Critical); 3];
    for (i, (p, g, tpm, conc)) in [
        (Priority::Critical, 2, Some(3000), None),
        (Priority::Standard, 0, None, Some(3)),
        (Priority::Sheddable, 0, None, None),
    ]
    .into_iter()
    .enumerate()
    {
        let id = a
            .add_tenant(
                &format!("t{i}"),
                &TenantConfig {
                    priority: p,
                    tokens_per_minute: tpm,
                    burst_tokens: None,
                    max_concurrency: conc,
                    guaranteed_slots: g,
                    guaranteed_backends: ALL_BACKENDS,
                },
            )
            .unwrap();
        tenants[i] = (id, p);
    }
    (a, mc, b, tenants)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

    /// The serialised mode (plain loads and stores, for callers that serialise every call)
    /// decides and counts exactly as compare-and-swap does, call for call: the same
    /// admissions and refusals (reasons and retry hints), the same snapshots after every
    /// step, through scale changes, shedding, refunds, overruns and clock steps, and
    /// nothing held at the end.
    #[test]
    fn serialized_mode_matches_atomic_mode(
        ops in proptest::collection::vec((0u8..6, 0u64..1_300, 0usize..3), 1..150)
    ) {
        let (x, mcx, b, tenants) = model_controller(Rmw::Atomic);
        let (y, mcy, _, _) = model_controller(Rmw::Serialized);
        let mut held: Vec<(Ticket, Ticket)> = Vec::new();
        for (op, n, k) in ops {
            match op {
                0..=2 => {
                    let (t, p) = tenants[k];
                    let (rx, ry) = (x.admit(b, t, p, n).unwrap(), y.admit(b, t, p, n).unwrap());
                    match (rx, ry) {
                        (Ok(tx), Ok(ty)) => {
                            proptest::prop_assert_eq!(tx, ty);
                            held.push((tx, ty));
                        }
                        (rx, ry) => proptest::prop_assert_eq!(rx, ry),
                    }
                }
                3 if !held.is_empty() => {
                    let (tx, ty) = held.swap_remove(n as usize % held.len());
                    let actual = (k > 0).then_some(n);
                    x.release(&tx, actual).unwrap();
                    y.release(&ty, actual).unwrap();
                }
                4 => {
                    mcx.advance_ns(n * 10_000_000);
                    mcy.advance_ns(n * 10_000_000);
                }
                5 => {
                    let scale = [0.6, 0.8, 1.0][k];
                    x.set_scale(b, scale).unwrap();
                    y.set_scale(b, scale).unwrap();
                    x.set_shedding(b, n % 2 == 0).unwrap();
                    y.set_shedding(b, n % 2 == 0).unwrap();
                    x.set_overload(b, n % 3 == 0).unwrap();
                    y.set_overload(b, n % 3 == 0).unwrap();
                    // external KV occupancy: none, some, or above the whole budget
                    let external = [0, n / 2, n][k];
                    x.set_inflight_external(b, external).unwrap();
                    y.set_inflight_external(b, external).unwrap();
                }
                _ => {}
            }
            proptest::prop_assert_eq!(x.backend_state(b).unwrap(), y.backend_state(b).unwrap());
            for (t, _) in tenants {
                proptest::prop_assert_eq!(x.tenant_state(t).unwrap(), y.tenant_state(t).unwrap());
            }
        }
        for (tx, ty) in held.drain(..) {
            x.release(&tx, None).unwrap();
            y.release(&ty, None).unwrap();
        }
        let (sx, sy) = (x.backend_state(b).unwrap(), y.backend_state(b).unwrap());
        proptest::prop_assert_eq!((sx.in_use, sx.inflight_tokens), (0, 0));
        proptest::prop_assert_eq!(sx, sy);
    }
}

#[test]
fn zero_tokens_fit_above_a_lowered_budget_in_both_modes() {
    // Found by `serialized_mode_matches_atomic_mode`: the serialised mode refused a
    // zero-token request while the in-flight tokens were above the budget in force.
    for rmw in [Rmw::Atomic, Rmw::Serialized] {
        let (a, _mc, b, [(crit, pc), (std_t, ps), _]) = model_controller(rmw);
        assert!(a.admit(b, crit, pc, 801).unwrap().is_ok(), "{rmw:?}");
        a.set_inflight_external(b, 300).unwrap(); // budget in force 700 < 801 held
        assert!(a.admit(b, std_t, ps, 0).unwrap().is_ok(), "{rmw:?}");
        assert_eq!(a.backend_state(b).unwrap().inflight_tokens, 801, "{rmw:?}");
    }
}

#[test]
fn admits_and_releases_everything() {
    let (a, _mc, b) = setup();
    let t = tenant(&a, "t", Priority::Standard, 0, Some(600));
    let tk = a.admit(b, t, Priority::Standard, 100).unwrap().unwrap();
    let s = a.backend_state(b).unwrap();
    assert_eq!(
        (s.in_use, s.inflight_tokens, s.available_tokens),
        (1, 100, 5900)
    );
    a.release(&tk, Some(40)).unwrap();
    let s = a.backend_state(b).unwrap();
    assert_eq!(
        (s.in_use, s.inflight_tokens, s.available_tokens),
        (0, 0, 5960)
    );
    assert_eq!(a.tenant_state(t).unwrap().available_tokens, Some(560));
}

#[test]
fn refusal_reasons_and_nothing_held() {
    let (a, _mc, b) = setup();
    let t = tenant(&a, "t", Priority::Standard, 0, Some(600));
    let r = a.admit(b, t, Priority::Standard, 601).unwrap().unwrap_err();
    assert_eq!((r.reason, r.retry_after_ns), (Reason::TenantTpm, None));
    let zero = a.admit(b, t, Priority::Standard, 0).unwrap().unwrap();
    a.release(&zero, None).unwrap();
    let u = tenant(&a, "u", Priority::Standard, 0, None);
    let r = a
        .admit(b, u, Priority::Standard, 1001)
        .unwrap()
        .unwrap_err();
    assert_eq!((r.reason, r.retry_after_ns), (Reason::InflightTokens, None));
    let mut held: Vec<_> = (0..3)
        .map(|_| a.admit(b, u, Priority::Standard, 300).unwrap().unwrap())
        .collect();
    let r = a.admit(b, u, Priority::Standard, 200).unwrap().unwrap_err();
    assert_eq!(r.reason, Reason::InflightTokens);
    assert!(r.retry_after_ns.is_some());
    held.push(a.admit(b, u, Priority::Standard, 50).unwrap().unwrap());
    let r = a.admit(b, u, Priority::Standard, 1).unwrap().unwrap_err();
    assert_eq!(r.reason, Reason::BackendSlots);
    assert_eq!(r.reason.scope(), "backend");
    let s = a.backend_state(b).unwrap();
    assert_eq!((s.in_use, s.inflight_tokens), (4, 950));
    for tk in &held {
        a.release(tk, None).unwrap();
    }
    a.set_shedding(b, true).unwrap();
    let r = a.admit(b, u, Priority::Sheddable, 1).unwrap().unwrap_err();
    assert_eq!(r.reason, Reason::Shed);
    assert!(a.admit(b, u, Priority::Critical, 1).unwrap().is_ok());
}

#[test]
fn guarantees_and_burst_pool_under_scale() {
    let (a, _mc, b) = setup(); // 4 slots
    let gold = tenant(&a, "gold", Priority::Critical, 2, None);
    let batch = tenant(&a, "batch", Priority::Sheddable, 0, None);
    // Burst pool = 4 - 2 = 2: sheddable gets two, not more.
    let s1 = a.admit(b, batch, Priority::Sheddable, 1).unwrap().unwrap();
    let _s2 = a.admit(b, batch, Priority::Sheddable, 1).unwrap().unwrap();
    assert_eq!(
        a.admit(b, batch, Priority::Sheddable, 1)
            .unwrap()
            .unwrap_err()
            .reason,
        Reason::BackendSlots
    );
    // The guarantee is still there for gold.
    let g1 = a.admit(b, gold, Priority::Critical, 1).unwrap().unwrap();
    assert_eq!(g1.pool, Pool::Guaranteed);
    let _g2 = a.admit(b, gold, Priority::Critical, 1).unwrap().unwrap();
    assert!(a.admit(b, gold, Priority::Critical, 1).unwrap().is_err());
    // Scale 0.5: limit 2 -> burst pool 0, guarantees intact.
    a.set_scale(b, 0.5).unwrap();
    a.release(&s1, None).unwrap();
    assert!(a.admit(b, batch, Priority::Sheddable, 1).unwrap().is_err());
    a.release(&g1, None).unwrap();
    assert!(a.admit(b, gold, Priority::Critical, 1).unwrap().is_ok());
    // Scale 0.25 while overloaded (the scale binds critical too): limit 1 < guarantees 2 ->
    // gold keeps only 1 (already held 2).
    a.set_scale(b, 0.25).unwrap();
    a.set_overload(b, true).unwrap();
    assert_eq!(a.backend_state(b).unwrap().burst_pool, 0);
    assert!(a.admit(b, gold, Priority::Critical, 1).unwrap().is_err());
    assert!(a.set_scale(b, 0.0).is_err());
    assert!(a.set_scale(b, 1.5).is_err());
}

#[test]
fn between_the_watermarks_the_scale_binds_the_sheddable_class_first() {
    // Scale 0.5, not overloaded: sheddable fits under 0.5 × 4 = 2 slots counting every class's,
    // critical and standard keep all 4 (shedding or not); once overloaded, the scaled limit
    // binds them too.
    let (a, _mc, b) = setup(); // 4 slots, 6,000 TPM, 1,000 in-flight tokens
    let std_t = tenant(&a, "std", Priority::Standard, 0, None);
    let batch = tenant(&a, "batch", Priority::Sheddable, 0, None);
    a.set_scale(b, 0.5).unwrap();
    let s1 = a.admit(b, batch, Priority::Sheddable, 10).unwrap().unwrap();
    let d1 = a.admit(b, std_t, Priority::Standard, 10).unwrap().unwrap();
    // 2 held (one of each): the sheddable class is at its scaled limit
    let r = a
        .admit(b, batch, Priority::Sheddable, 10)
        .unwrap()
        .unwrap_err();
    assert_eq!(r.reason, Reason::BackendSlots);
    // standard keeps the base limit: 4 in all
    let d2 = a.admit(b, std_t, Priority::Standard, 10).unwrap().unwrap();
    let d3 = a.admit(b, std_t, Priority::Standard, 10).unwrap().unwrap();
    let r = a
        .admit(b, std_t, Priority::Standard, 10)
        .unwrap()
        .unwrap_err();
    assert_eq!(r.reason, Reason::BackendSlots);
    // TPM: standard is charged at the base rate (6,000/min), sheddable at the scaled one
    assert_eq!((d1.backend_rate, s1.backend_rate), (6000, 3000));
    for tk in [&s1, &d1, &d2] {
        a.release(tk, None).unwrap();
    }
    // Shedding: sheddable refused as a whole, standard still at the base rate and limit
    a.set_shedding(b, true).unwrap();
    let r = a
        .admit(b, batch, Priority::Sheddable, 10)
        .unwrap()
        .unwrap_err();
    assert_eq!(r.reason, Reason::Shed);
    let d2 = a.admit(b, std_t, Priority::Standard, 10).unwrap().unwrap();
    assert_eq!(d2.backend_rate, 6000);
    a.release(&d2, None).unwrap();
    // Overloaded: standard held to the scaled 2 (1 held: d3) at the scaled rate
    a.set_overload(b, true).unwrap();
    let s = a.backend_state(b).unwrap();
    assert!(s.shedding && s.overloaded);
    let d4 = a.admit(b, std_t, Priority::Standard, 10).unwrap().unwrap();
    assert_eq!(d4.backend_rate, 3000);
    let r = a
        .admit(b, std_t, Priority::Standard, 10)
        .unwrap()
        .unwrap_err();
    assert_eq!(r.reason, Reason::BackendSlots);
    a.release(&d3, None).unwrap();
    a.release(&d4, None).unwrap();
    // the two flags are independent bits: overload off leaves shedding on
    a.set_overload(b, false).unwrap();
    let s = a.backend_state(b).unwrap();
    assert!(s.shedding && !s.overloaded);
    assert_eq!((s.in_use, s.inflight_tokens, s.burst_in_use), (0, 0, 0));
}

#[test]
fn the_scale_leaves_the_inflight_budget_alone() {
    // The in-flight budget is the engine's KV capacity already: scaling it by KV pressure too
    // counted that pressure twice and pushed it below the tokens in flight (long generations
    // holding their reservations), refusing every request but guaranteed-slot ones.
    let (a, _mc, b) = setup(); // 4 slots, in-flight budget 1000 tokens
    let std_t = tenant(&a, "std", Priority::Standard, 0, None);
    let long = a.admit(b, std_t, Priority::Standard, 700).unwrap().unwrap();
    a.set_scale(b, 0.6).unwrap(); // the floor: 0.6 × 1000 = 600 < 700 held
    a.set_overload(b, true).unwrap(); // overloaded: the scale binds standard too
    let s = a.backend_state(b).unwrap();
    assert_eq!(
        (s.effective_concurrency, s.effective_inflight_token_limit),
        (2, Some(1000))
    );
    assert_eq!(s.inflight_external_tokens, 0);
    let short = a.admit(b, std_t, Priority::Standard, 300).unwrap().unwrap();
    assert_eq!(short.pool, Pool::Burst);
    // Slots are scaled: 2 of 4 held, no third.
    let r = a
        .admit(b, std_t, Priority::Standard, 0)
        .unwrap()
        .unwrap_err();
    assert_eq!(r.reason, Reason::BackendSlots);
    a.release(&short, None).unwrap();
    a.release(&long, None).unwrap();
    assert_eq!(a.backend_state(b).unwrap().inflight_tokens, 0);
}

#[test]
fn external_occupancy_lowers_the_budget_for_every_request() {
    let (a, _mc, b) = setup(); // 4 slots, in-flight budget 1000 tokens
    let gold = tenant(&a, "gold", Priority::Critical, 1, None);
    let std_t = tenant(&a, "std", Priority::Standard, 0, None);
    let long = a.admit(b, std_t, Priority::Standard, 500).unwrap().unwrap();
    // Another client holds 300 tokens of the engine's cache: 700 in force.
    a.set_inflight_external(b, 300).unwrap();
    let s = a.backend_state(b).unwrap();
    assert_eq!(
        (
            s.inflight_token_limit,
            s.inflight_external_tokens,
            s.effective_inflight_token_limit
        ),
        (Some(1000), 300, Some(700))
    );
    let r = a
        .admit(b, std_t, Priority::Standard, 201)
        .unwrap()
        .unwrap_err();
    assert_eq!(r.reason, Reason::InflightTokens);
    // It fits once something is released.
    assert!(r.retry_after_ns.is_some());
    // A guaranteed slot is held to the same budget (the other client's tokens are real)...
    let r = a
        .admit(b, gold, Priority::Critical, 201)
        .unwrap()
        .unwrap_err();
    assert_eq!(r.reason, Reason::InflightTokens);
    // ...and gets exactly what is left.
    let g = a.admit(b, gold, Priority::Critical, 200).unwrap().unwrap();
    assert_eq!(g.pool, Pool::Guaranteed);
    assert_eq!(a.backend_state(b).unwrap().inflight_tokens, 700);
    // Larger than the budget in force but not than the base: retry when the budget grows.
    a.release(&g, None).unwrap();
    a.release(&long, None).unwrap();
    let r = a
        .admit(b, std_t, Priority::Standard, 701)
        .unwrap()
        .unwrap_err();
    assert_eq!(
        (r.reason, r.retry_after_ns),
        (Reason::InflightTokens, Some(SCALE_RETRY_NS))
    );
    // Above the base: never, whatever the occupancy.
    let r = a
        .admit(b, gold, Priority::Critical, 1001)
        .unwrap()
        .unwrap_err();
    assert_eq!((r.reason, r.retry_after_ns), (Reason::InflightTokens, None));
    // Occupancy above the base: nothing fits but zero tokens; nothing is held after refusals.
    a.set_inflight_external(b, 5000).unwrap();
    assert_eq!(
        a.backend_state(b).unwrap().effective_inflight_token_limit,
        Some(0)
    );
    assert!(a.admit(b, gold, Priority::Critical, 1).unwrap().is_err());
    let z = a.admit(b, gold, Priority::Critical, 0).unwrap().unwrap();
    a.release(&z, None).unwrap();
    // Back to 0: the base budget again.
    a.set_inflight_external(b, 0).unwrap();
    let full = a
        .admit(b, std_t, Priority::Standard, 1000)
        .unwrap()
        .unwrap();
    a.release(&full, None).unwrap();
    let s = a.backend_state(b).unwrap();
    assert_eq!((s.in_use, s.inflight_tokens, s.burst_in_use), (0, 0, 0));
    // A bad amount or id is refused and changes nothing.
    assert!(a.set_inflight_external(b, MAX_AMOUNT + 1).is_err());
    assert!(a.set_inflight_external(99, 1).is_err());
    assert_eq!(a.backend_state(b).unwrap().inflight_external_tokens, 0);
    // An unlimited budget stays unlimited.
    let u = a
        .add_backend(
            "open",
            &BackendConfig {
                max_concurrency: 4,
                tokens_per_minute: 6000,
                burst_tokens: None,
                inflight_token_limit: None,
            },
        )
        .unwrap();
    a.set_inflight_external(u, 10_000).unwrap();
    let s = a.backend_state(u).unwrap();
    assert_eq!(
        (s.inflight_external_tokens, s.effective_inflight_token_limit),
        (10_000, None)
    );
    assert!(a.admit(u, std_t, Priority::Standard, 5000).unwrap().is_ok());
}

#[test]
fn config_validation() {
    let (a, _mc, _b) = setup();
    let bad = TenantConfig {
        priority: Priority::Sheddable,
        tokens_per_minute: None,
        burst_tokens: None,
        max_concurrency: None,
        guaranteed_slots: 1,
        guaranteed_backends: ALL_BACKENDS,
    };
    assert!(a.add_tenant("x", &bad).is_err());
    let too_many = TenantConfig {
        priority: Priority::Critical,
        guaranteed_slots: 5,
        ..bad
    };
    assert!(a.add_tenant("x", &too_many).is_err());
    assert!(a.admit(9, 0, Priority::Critical, 1).is_err());
}

fn two_backends() -> (Arc<Admission>, u32, u32) {
    let (a, _mc, b0) = setup(); // 4 slots
    let b1 = a
        .add_backend(
            "b1",
            &BackendConfig {
                max_concurrency: 4,
                tokens_per_minute: 6000,
                burst_tokens: None,
                inflight_token_limit: None,
            },
        )
        .unwrap();
    (a, b0, b1)
}

fn scoped(p: Priority, g: u64, backends: &[u32]) -> TenantConfig {
    TenantConfig {
        priority: p,
        tokens_per_minute: None,
        burst_tokens: None,
        max_concurrency: None,
        guaranteed_slots: g,
        guaranteed_backends: GuaranteedBackends::Only(backends.to_vec()),
    }
}

#[test]
fn guarantee_applies_only_to_its_backends() {
    let (a, b0, b1) = two_backends();
    let gold = a
        .add_tenant("gold", &scoped(Priority::Critical, 3, &[b0]))
        .unwrap();
    let other = tenant(&a, "other", Priority::Standard, 0, None);
    let (s0, s1) = (a.backend_state(b0).unwrap(), a.backend_state(b1).unwrap());
    assert_eq!((s0.guaranteed_slots, s0.burst_pool), (3, 1));
    assert_eq!((s1.guaranteed_slots, s1.burst_pool), (0, 4));
    let ts = a.tenant_state(gold).unwrap();
    assert_eq!((ts.guaranteed_slots, ts.guaranteed_backends), (3, vec![b0]));
    // b1's burst pool is whole: four burst slots for anyone, gold's requests included.
    let g = a.admit(b1, gold, Priority::Critical, 1).unwrap().unwrap();
    assert_eq!(g.pool, Pool::Burst);
    let held: Vec<_> = (0..3)
        .map(|_| a.admit(b1, other, Priority::Standard, 1).unwrap().unwrap())
        .collect();
    assert!(held.iter().all(|tk| tk.pool == Pool::Burst));
    let r = a
        .admit(b1, gold, Priority::Critical, 1)
        .unwrap()
        .unwrap_err();
    assert_eq!(r.reason, Reason::BackendSlots);
    // b0: one burst slot for others, three only for gold.
    let o = a.admit(b0, other, Priority::Standard, 1).unwrap().unwrap();
    assert!(a.admit(b0, other, Priority::Standard, 1).unwrap().is_err());
    for _ in 0..3 {
        let tk = a.admit(b0, gold, Priority::Critical, 1).unwrap().unwrap();
        assert_eq!(tk.pool, Pool::Guaranteed);
    }
    a.release(&o, None).unwrap();
    a.release(&g, None).unwrap();
    for tk in &held {
        a.release(tk, None).unwrap();
    }
    assert_eq!(a.backend_state(b1).unwrap().in_use, 0);
    assert_eq!(a.backend_state(b0).unwrap().in_use, 3);
}

#[test]
fn guarantee_sums_are_checked_per_backend() {
    let (a, b0, b1) = two_backends(); // 4 slots each
    a.add_tenant("g0", &scoped(Priority::Critical, 3, &[b0]))
        .unwrap();
    // 3 + 3 fits nowhere if both were on every backend; on separate backends it fits.
    let g1 = a
        .add_tenant("g1", &scoped(Priority::Critical, 3, &[b1]))
        .unwrap();
    // On every backend: b0 would hold 3 + 2 > 4.
    let all = TenantConfig {
        guaranteed_backends: ALL_BACKENDS,
        ..scoped(Priority::Critical, 2, &[])
    };
    let e = a.add_tenant("x", &all).unwrap_err().to_string();
    assert!(e.contains("\"b0\"") && e.contains("total 5"), "{e}");
    assert_eq!(a.tenant_id("x"), None);
    // A backend id that is not registered.
    let e = a
        .add_tenant("y", &scoped(Priority::Critical, 1, &[5]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("backend id 5"), "{e}");
    // Nothing changed by the refusals.
    assert_eq!(a.backend_state(b0).unwrap().guaranteed_slots, 3);
    assert_eq!(a.backend_state(b1).unwrap().guaranteed_slots, 3);
    // One slot on every backend fits (4 and 4), also on a backend added later.
    let one = a
        .add_tenant(
            "one",
            &TenantConfig {
                guaranteed_backends: ALL_BACKENDS,
                ..scoped(Priority::Standard, 1, &[])
            },
        )
        .unwrap();
    let mut cfg = BackendConfig {
        max_concurrency: 1,
        tokens_per_minute: 6000,
        burst_tokens: None,
        inflight_token_limit: None,
    };
    let b2 = a.add_backend("b2", &cfg).unwrap();
    assert_eq!(a.backend_state(b2).unwrap().guaranteed_slots, 1);
    assert_eq!(
        a.tenant_state(one).unwrap().guaranteed_backends,
        vec![b0, b1, b2]
    );
    assert_eq!(a.tenant_state(g1).unwrap().guaranteed_backends, vec![b1]);
    let tk = a.admit(b2, one, Priority::Standard, 1).unwrap().unwrap();
    assert_eq!(tk.pool, Pool::Guaranteed);
    a.release(&tk, None).unwrap();
    // b1 cannot shrink below its own total (3 + 1); b2 is not bound by b0's.
    cfg.max_concurrency = 3;
    assert!(a.update_backend(b1, &cfg).is_err());
    cfg.max_concurrency = 2;
    a.update_backend(b2, &cfg).unwrap();
    // A new backend must have room for the every-backend guarantees only.
    cfg.max_concurrency = 1;
    assert!(a.add_backend("b3", &cfg).is_ok());
}

#[test]
fn moving_a_guarantee_keeps_held_slots() {
    let (a, b0, b1) = two_backends(); // 4 slots each
    let gold = a
        .add_tenant("gold", &scoped(Priority::Critical, 2, &[b0]))
        .unwrap();
    let other = tenant(&a, "other", Priority::Standard, 0, None);
    let held: Vec<_> = (0..2)
        .map(|_| a.admit(b0, gold, Priority::Critical, 10).unwrap().unwrap())
        .collect();
    assert!(held.iter().all(|tk| tk.pool == Pool::Guaranteed));
    a.update_tenant(gold, &scoped(Priority::Critical, 2, &[b1]))
        .unwrap();
    let (s0, s1) = (a.backend_state(b0).unwrap(), a.backend_state(b1).unwrap());
    assert_eq!((s0.guaranteed_slots, s0.in_use), (0, 2));
    assert_eq!((s1.guaranteed_slots, s1.burst_pool), (2, 2));
    assert_eq!(a.tenant_state(gold).unwrap().in_use, 2);
    // b0: the held slots still count, so the grown burst pool stops at the limit.
    let burst: Vec<_> = (0..2)
        .map(|_| a.admit(b0, other, Priority::Standard, 1).unwrap().unwrap())
        .collect();
    let r = a
        .admit(b0, other, Priority::Standard, 1)
        .unwrap()
        .unwrap_err();
    assert_eq!(r.reason, Reason::BackendSlots);
    // b1: gold's guarantee is there now.
    let g1 = a.admit(b1, gold, Priority::Critical, 1).unwrap().unwrap();
    assert_eq!(g1.pool, Pool::Guaranteed);
    // The old tickets release cleanly; b0 is then all burst pool.
    for tk in held.iter().chain(&burst) {
        a.release(tk, None).unwrap();
    }
    let s0 = a.backend_state(b0).unwrap();
    assert_eq!((s0.in_use, s0.inflight_tokens, s0.burst_in_use), (0, 0, 0));
    let four: Vec<_> = (0..4)
        .map(|_| a.admit(b0, other, Priority::Standard, 1).unwrap().unwrap())
        .collect();
    assert_eq!(four.len(), 4);
    assert_eq!(a.tenant_state(gold).unwrap().in_use, 1);
    // A move that does not fit is refused and changes nothing.
    a.add_tenant("big", &scoped(Priority::Critical, 3, &[b0]))
        .unwrap();
    assert!(a
        .update_tenant(gold, &scoped(Priority::Critical, 2, &[b0, b1]))
        .is_err());
    assert_eq!(
        a.tenant_config(gold).unwrap().guaranteed_backends,
        GuaranteedBackends::Only(vec![b1])
    );
    assert_eq!(a.backend_state(b0).unwrap().guaranteed_slots, 3);
}

#[test]
fn shm_shared_and_reclaim() {
    let name = format!("kvgate-test-adm-{}", std::process::id());
    let a = Admission::create_shm(&name, Clock::Monotonic).unwrap();
    let b = a
        .add_backend(
            "b",
            &BackendConfig {
                max_concurrency: 3,
                tokens_per_minute: 1_000_000,
                burst_tokens: None,
                inflight_token_limit: None,
            },
        )
        .unwrap();
    let t = tenant(&a, "t", Priority::Standard, 0, None);
    let w = Admission::attach_shm(&name, Clock::Monotonic).unwrap();
    assert_eq!(w.backend_id("b"), Some(b));
    let tk = w.admit(b, t, Priority::Standard, 10).unwrap().unwrap();
    assert_eq!(a.backend_state(b).unwrap().in_use, 1);
    // Pretend the worker died: mark its ledger with a pid that is not alive.
    let p = a.proc_at(w.proc_idx);
    p.pid.store(0x3fff_fff0, Ordering::Release);
    assert_eq!(a.reclaim_dead(), 1);
    let s = a.backend_state(b).unwrap();
    assert_eq!((s.in_use, s.inflight_tokens), (0, 0));
    assert_eq!(tk.tokens, 10);
}

#[test]
fn external_occupancy_is_shared_between_processes() {
    let name = format!("kvgate-test-ext-{}", std::process::id());
    let a = Admission::create_shm(&name, Clock::Monotonic).unwrap();
    let b = a
        .add_backend(
            "b",
            &BackendConfig {
                max_concurrency: 3,
                tokens_per_minute: 1_000_000,
                burst_tokens: None,
                inflight_token_limit: Some(1000),
            },
        )
        .unwrap();
    let t = tenant(&a, "t", Priority::Standard, 0, None);
    let w = Admission::attach_shm(&name, Clock::Monotonic).unwrap();
    a.set_inflight_external(b, 600).unwrap(); // set by one process...
    let s = w.backend_state(b).unwrap(); // ...in force in the other
    assert_eq!(
        (s.inflight_external_tokens, s.effective_inflight_token_limit),
        (600, Some(400))
    );
    let r = w.admit(b, t, Priority::Standard, 401).unwrap().unwrap_err();
    assert_eq!(r.reason, Reason::InflightTokens);
    let tk = w.admit(b, t, Priority::Standard, 400).unwrap().unwrap();
    w.release(&tk, None).unwrap();
    assert_eq!(a.backend_state(b).unwrap().inflight_tokens, 0);
}

#[test]
fn hold_time_ewma_is_sampled_with_the_system_clock() {
    let a = Admission::new_heap(Clock::Monotonic).unwrap();
    let b = a
        .add_backend(
            "b",
            &BackendConfig {
                max_concurrency: 4,
                tokens_per_minute: 1_000_000,
                burst_tokens: None,
                inflight_token_limit: None,
            },
        )
        .unwrap();
    let t = tenant(&a, "t", Priority::Standard, 0, None);
    let hold = |a: &Admission| a.backend_state(b).unwrap().hold_time_ewma_ns;
    // The first release is always timed: the EWMA starts from a measured hold.
    let tk = a.admit(b, t, Priority::Standard, 10).unwrap().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    a.release(&tk, None).unwrap();
    let first = hold(&a);
    // The clock advances by ticks: a 20 ms hold reads at least 20 ms less one tick.
    let tick = crate::clock::resolution_ns();
    assert!(first >= 20_000_000 - tick.min(20_000_000), "{first}");
    // Then about one release in HOLD_SAMPLE_EVERY: a run of instant releases moves the EWMA
    // down, by one 1/8 step per sampled release, so far less than if every release were
    // timed (0.875^64 of the first hold, about 0.02%).
    for _ in 0..HOLD_SAMPLE_EVERY * 8 {
        let tk = a.admit(b, t, Priority::Standard, 10).unwrap().unwrap();
        a.release(&tk, None).unwrap();
    }
    let after = hold(&a);
    assert!(after < first, "{after} vs {first}");
    assert!(after > first / 1000, "{after}: every release was timed");
    assert_eq!(a.backend_state(b).unwrap().in_use, 0);
}

#[test]
fn refund_gives_back_what_was_charged_across_a_scale_change() {
    let mc = Arc::new(ManualClock::new(0));
    let a = Admission::new_heap(Clock::Manual(mc.clone())).unwrap();
    let b = a
        .add_backend(
            "b",
            &BackendConfig {
                max_concurrency: 8,
                tokens_per_minute: 6000, // 100 tokens/s
                burst_tokens: Some(3000),
                inflight_token_limit: None,
            },
        )
        .unwrap();
    let t = tenant(&a, "t", Priority::Standard, 0, Some(6000));
    let avail = |a: &Admission| a.backend_state(b).unwrap().available_tokens;
    let tenant_avail = |a: &Admission| a.tenant_state(t).unwrap().available_tokens;
    // use 2000 of the 3000: the refunds below are not hidden by the cap at a full bucket
    let tk = a.admit(b, t, Priority::Standard, 2000).unwrap().unwrap();
    a.release(&tk, None).unwrap();
    let (b0, t0) = (avail(&a), tenant_avail(&a));
    assert_eq!((b0, t0), (1000, Some(4000)));
    for (at_admit, at_release) in [(1.0, 0.6), (0.6, 1.0), (1.0, 1.0)] {
        a.set_scale(b, at_admit).unwrap();
        let tk = a.admit(b, t, Priority::Standard, 500).unwrap().unwrap();
        a.set_scale(b, at_release).unwrap();
        a.release(&tk, Some(0)).unwrap(); // nothing used: all 500 back
        a.set_scale(b, 1.0).unwrap();
        // as before, to within the rounding that never grants (cost up, refund down: 1 ns)
        let got = avail(&a);
        assert!(
            (b0 - 1..=b0).contains(&got),
            "admit at {at_admit}, release at {at_release}: {got} vs {b0}"
        );
        assert_eq!(tenant_avail(&a), t0);
    }
    let b0 = avail(&a);
    // a partial refund under a lower scale returns the unused part at the admission's rate
    let tk = a.admit(b, t, Priority::Standard, 900).unwrap().unwrap();
    a.set_scale(b, 0.6).unwrap();
    a.release(&tk, Some(400)).unwrap();
    a.set_scale(b, 1.0).unwrap();
    assert!((b0 - 401..=b0 - 400).contains(&avail(&a)), "{}", avail(&a));
    // an overrun is charged at the rates in force when it is reported
    mc.advance_ns(60_000_000_000); // full again
    let tk = a.admit(b, t, Priority::Standard, 100).unwrap().unwrap();
    a.release(&tk, Some(700)).unwrap();
    assert_eq!(avail(&a), 3000 - 700);
    assert_eq!(tenant_avail(&a), Some(6000 - 700));
}

#[test]
fn hold_time_samples_reach_every_backend_of_a_round_robin() {
    let a = Admission::new_heap(Clock::Monotonic).unwrap();
    let cfg = BackendConfig {
        max_concurrency: 4,
        tokens_per_minute: 1_000_000,
        burst_tokens: None,
        inflight_token_limit: None,
    };
    let ids: Vec<u32> = (0..8)
        .map(|i| a.add_backend(&format!("b{i}"), &cfg).unwrap())
        .collect();
    let t = tenant(&a, "t", Priority::Standard, 0, None);
    // First releases after a 20 ms hold: every backend's EWMA starts there.
    let held: Vec<Ticket> = ids
        .iter()
        .map(|&b| a.admit(b, t, Priority::Standard, 1).unwrap().unwrap())
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(20));
    for tk in &held {
        a.release(tk, None).unwrap();
    }
    // Then one thread releases round-robin over the eight: each must see samples.
    for _ in 0..200 {
        for &b in &ids {
            let tk = a.admit(b, t, Priority::Standard, 1).unwrap().unwrap();
            a.release(&tk, None).unwrap();
        }
    }
    for &b in &ids {
        let h = a.backend_state(b).unwrap().hold_time_ewma_ns;
        assert!(
            h < 10_000_000,
            "backend {b}: EWMA {h} ns never sampled again"
        );
    }
}

/// Rust-only throughput of admit + release (run with
/// `cargo test --release -p kvgate-core --no-default-features -- --ignored --nocapture`).
#[test]
#[ignore = "benchmark"]
fn bench_admit_release() {
    // The mode the Python bindings give a private controller (the GIL serialises calls).
    let a = Admission::new_heap_serialized(Clock::Monotonic).unwrap();
    let b = a
        .add_backend(
            "b",
            &BackendConfig {
                max_concurrency: 1024,
                tokens_per_minute: MAX_AMOUNT,
                burst_tokens: None,
                inflight_token_limit: Some(1 << 40),
            },
        )
        .unwrap();
    let t = a
        .add_tenant(
            "t",
            &TenantConfig {
                priority: Priority::Standard,
                tokens_per_minute: Some(MAX_AMOUNT),
                burst_tokens: None,
                max_concurrency: Some(1024),
                guaranteed_slots: 0,
                guaranteed_backends: ALL_BACKENDS,
            },
        )
        .unwrap();
    let n = 5_000_000u32;
    let start = std::time::Instant::now();
    for _ in 0..n {
        let tk = a.admit(b, t, Priority::Standard, 500).unwrap().unwrap();
        a.release(&tk, Some(400)).unwrap();
    }
    let el = start.elapsed().as_secs_f64();
    println!(
        "rust admit+release: {n} pairs in {el:.3} s = {:.0} pairs/s ({:.1} ns/pair)",
        f64::from(n) / el,
        el * 1e9 / f64::from(n)
    );
    assert_eq!(a.backend_state(b).unwrap().in_use, 0);
}

/// The two primitives admit + release are built from, timed alone: one atomic
/// read-modify-write (a `fetch_add` / `fetch_sub` on one of twelve counters in separate
/// cache lines, as the limits are) and one `CLOCK_MONOTONIC` reading. A pair makes twelve of
/// the first (six limits each way) and one of the second; `benches/core_results.py` turns
/// this line into the floor under the pair's cost.
#[test]
#[ignore = "benchmark"]
fn bench_floor_primitives() {
    #[repr(align(64))]
    struct Line(AtomicU64);
    let counters: Vec<Line> = (0..12).map(|_| Line(AtomicU64::new(1 << 40))).collect();
    let rounds = 2_000_000u32;
    let start = std::time::Instant::now();
    for i in 0..rounds {
        for c in &counters {
            if i % 2 == 0 {
                c.0.fetch_add(1, Ordering::AcqRel);
            } else {
                c.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
    let rmw_ns = start.elapsed().as_secs_f64() * 1e9 / f64::from(rounds) / 12.0;
    assert!(counters
        .iter()
        .all(|c| c.0.load(Ordering::Relaxed) == 1 << 40));
    let reads = 5_000_000u32;
    let time_reads = |read: &dyn Fn() -> u64| {
        let start = std::time::Instant::now();
        let mut sum = 0u64;
        for _ in 0..reads {
            sum = sum.wrapping_add(std::hint::black_box(read)());
        }
        assert!(sum > 0);
        start.elapsed().as_secs_f64() * 1e9 / f64::from(reads)
    };
    let clock = Clock::Monotonic;
    let clock_ns = time_reads(&|| clock.now_ns());
    let precise_ns = time_reads(&crate::clock::precise_monotonic_ns);
    println!(
        "rust floor: atomic read-modify-write {rmw_ns:.2} ns, \
         clock_gettime(CLOCK_MONOTONIC_COARSE) {clock_ns:.2} ns \
         (CLOCK_MONOTONIC {precise_ns:.2} ns)"
    );
}

/// A private core of one process sized for `backends`, `tenants` and `guarantees` entries.
fn heap_core(backends: u32, tenants: u32, guarantees: u32) -> Arc<Admission> {
    let cap = Capacity {
        backends,
        tenants,
        guarantees,
        processes: 1,
    };
    Admission::new_heap_with(Clock::Monotonic, cap).unwrap()
}

fn big_backend(a: &Admission, name: &str, conc: u64) -> u32 {
    a.add_backend(
        name,
        &BackendConfig {
            max_concurrency: conc,
            tokens_per_minute: 1 << 40,
            burst_tokens: None,
            inflight_token_limit: None,
        },
    )
    .unwrap()
}

fn limited(p: Priority, conc: u64, g: u64, backends: GuaranteedBackends) -> TenantConfig {
    TenantConfig {
        priority: p,
        tokens_per_minute: Some(1_000_000),
        burst_tokens: None,
        max_concurrency: Some(conc),
        guaranteed_slots: g,
        guaranteed_backends: backends,
    }
}

/// Registers `n_backends` backends (8 slots each) and `n_tenants` tenants (2 at once each;
/// every 1,000th one with 1 guaranteed slot on one backend, spread over the backends, and one
/// more tenant with 1 guaranteed slot on every backend), then checks admission per tenant.
fn at_scale(a: &Admission, n_backends: u32, n_tenants: u32) {
    for i in 0..n_backends {
        assert_eq!(big_backend(a, &format!("backend-{i}"), 8), i);
    }
    for i in 0..n_tenants {
        let c = if i % 1000 == 0 {
            let on = GuaranteedBackends::Only(vec![(i / 1000 * 7) % n_backends]);
            limited(Priority::Critical, 2, 1, on)
        } else {
            limited(Priority::Standard, 2, 0, ALL_BACKENDS)
        };
        assert_eq!(a.add_tenant(&format!("tenant-{i}"), &c).unwrap(), i);
    }
    let everywhere = a
        .add_tenant(
            "everywhere",
            &limited(Priority::Critical, 2, 1, ALL_BACKENDS),
        )
        .unwrap();
    assert_eq!(a.tenant_id("tenant-99999"), Some(99_999));
    assert_eq!(
        a.tenant_id(&format!("tenant-{}", n_tenants / 2)),
        Some(n_tenants / 2)
    );
    assert_eq!(
        a.backend_id(&format!("backend-{}", n_backends - 1)),
        Some(n_backends - 1)
    );
    // A guarantee on a backend past id 64 (a u64 mask could not name it).
    let g = a.tenant_state(99_000).unwrap();
    assert_eq!(g.guaranteed_backends, vec![(99 * 7) % n_backends]);
    assert!(g.guaranteed_backends[0] >= 64);
    let last = n_backends - 1;
    assert_eq!(a.backend_state(last).unwrap().guaranteed_slots, 1); // `everywhere`
    let mut held = Vec::new();
    for i in (0..n_tenants).step_by(997).chain([99_000, n_tenants - 1]) {
        let p = a.tenant_config(i).unwrap().priority;
        let bi = if i % 1000 == 0 {
            a.tenant_state(i).unwrap().guaranteed_backends[0]
        } else {
            i % n_backends
        };
        let tk = a.admit(bi, i, p, 10).unwrap().unwrap();
        assert_eq!(
            tk.pool,
            if i % 1000 == 0 {
                Pool::Guaranteed
            } else {
                Pool::Burst
            },
            "tenant {i}"
        );
        held.push(tk);
        assert_eq!(a.tenant_state(i).unwrap().in_use, 1, "tenant {i}");
        assert_eq!(a.tenant_state(i + 1).unwrap().in_use, 0, "tenant {}", i + 1);
    }
    // the tenant's own limit (2 at once) binds per tenant
    let t = n_tenants - 1;
    held.push(a.admit(5, t, Priority::Standard, 10).unwrap().unwrap());
    let r = a.admit(6, t, Priority::Standard, 10).unwrap().unwrap_err();
    assert_eq!(r.reason, Reason::TenantConcurrency);
    let tk = a
        .admit(last, everywhere, Priority::Critical, 1)
        .unwrap()
        .unwrap();
    assert_eq!(tk.pool, Pool::Guaranteed);
    held.push(tk);
    for tk in &held {
        a.release(tk, Some(5)).unwrap();
    }
    for i in (0..n_tenants)
        .step_by(997)
        .chain([0, 99_000, n_tenants - 1, everywhere])
    {
        assert_eq!(a.tenant_state(i).unwrap().in_use, 0, "tenant {i}");
    }
    for bi in 0..n_backends {
        let s = a.backend_state(bi).unwrap();
        assert_eq!((s.in_use, s.burst_in_use, s.inflight_tokens), (0, 0, 0));
    }
}

#[test]
fn hundred_thousand_tenants_and_a_thousand_backends_on_the_heap() {
    let cap = Capacity::for_counts(1_000, 100_001, 1_100, 1);
    let a = Admission::new_heap_serialized_with(Clock::Monotonic, cap).unwrap();
    at_scale(&a, 1_000, 100_000);
    // Memory: proportional to the capacity (200,002 tenants, 2,000 backends, 2,200 guarantee
    // entries), far below tenants × backends words.
    assert!(std::mem::size_of::<TenantState>() <= 192);
    assert!(std::mem::size_of::<BackendState>() <= 320);
    assert_eq!(std::mem::size_of::<super::region::BoardEntry>(), 512);
    let bound = 200_002 * (192 + 8) + 2_000 * (320 + 512 + 24) + 8_192 * (32 + 8) + 4096;
    assert!(a.region_bytes() <= bound, "{} > {bound}", a.region_bytes());
    assert!(a.region_bytes() < 48 << 20, "{}", a.region_bytes());
}

#[test]
fn hundred_thousand_tenants_in_shared_memory_and_reclaim() {
    let name = format!("kvgate-test-scale-{}", std::process::id());
    let cap = Capacity::for_counts(1_000, 100_001, 1_100, 4);
    let a = Admission::create_shm_with(&name, Clock::Monotonic, cap).unwrap();
    let w = Admission::attach_shm(&name, Clock::Monotonic).unwrap();
    assert_eq!(w.capacity(), cap);
    at_scale(&w, 1_000, 100_000);
    // the creator sees the worker's registrations by name, and its admissions
    assert_eq!(a.tenant_id("tenant-77777"), Some(77_777));
    let bi = a.tenant_state(99_000).unwrap().guaranteed_backends[0];
    let tk = w
        .admit(bi, 99_000, Priority::Critical, 10)
        .unwrap()
        .unwrap();
    assert_eq!(tk.pool, Pool::Guaranteed);
    assert_eq!(a.tenant_state(99_000).unwrap().in_use, 1);
    assert_eq!(a.backend_state(bi).unwrap().in_use, 1);
    // the worker dies: what it held comes back
    w.proc_at(w.proc_idx)
        .pid
        .store(0x3fff_fff0, Ordering::Release);
    assert_eq!(a.reclaim_dead(), 1);
    assert_eq!(a.tenant_state(99_000).unwrap().in_use, 0);
    let s = a.backend_state(bi).unwrap();
    assert_eq!((s.in_use, s.inflight_tokens), (0, 0));
    let e = a.find_entry(99_000, bi).unwrap();
    assert_eq!(a.entry_at(e).in_use.load(Ordering::Acquire), 0);
}

#[test]
fn a_removed_tenant_id_is_reused_only_once_it_holds_nothing() {
    let a = heap_core(2, 2, 4);
    let b = big_backend(&a, "b", 4);
    let gold = a
        .add_tenant("gold", &limited(Priority::Critical, 2, 2, ALL_BACKENDS))
        .unwrap();
    let other = a
        .add_tenant("other", &limited(Priority::Standard, 2, 0, ALL_BACKENDS))
        .unwrap();
    let tk = a.admit(b, gold, Priority::Critical, 10).unwrap().unwrap();
    assert_eq!(tk.pool, Pool::Guaranteed);
    a.remove_tenant(gold).unwrap();
    assert!(a.remove_tenant(gold).is_err());
    assert!(a.tenant_removed(gold).unwrap());
    assert_eq!(a.tenant_id("gold"), None);
    // its guarantee went back to the burst pool; its held slot is still counted
    let s = a.backend_state(b).unwrap();
    assert_eq!((s.guaranteed_slots, s.in_use), (0, 1));
    let r = a
        .admit(b, gold, Priority::Critical, 1)
        .unwrap()
        .unwrap_err();
    assert_eq!(r.reason, Reason::TenantConcurrency);
    // full, and the removed tenant still holds a slot: its id is not given away
    let err = a
        .add_tenant("new", &limited(Priority::Standard, 1, 0, ALL_BACKENDS))
        .unwrap_err();
    assert!(err.to_string().contains("restart kvgate"), "{err}");
    assert_eq!(a.free_tenant_ids(), 0);
    a.release(&tk, None).unwrap();
    assert_eq!(a.free_tenant_ids(), 1);
    let new = a
        .add_tenant("new", &limited(Priority::Standard, 1, 0, ALL_BACKENDS))
        .unwrap();
    assert_eq!(new, gold);
    assert!(!a.tenant_removed(new).unwrap());
    assert_eq!(a.tenant_id("new"), Some(new));
    assert_eq!(a.tenant_id("other"), Some(other));
    let st = a.tenant_state(new).unwrap();
    assert_eq!(
        (st.name.as_str(), st.in_use, st.guaranteed_slots),
        ("new", 0, 0)
    );
    assert_eq!(st.max_concurrency, Some(1));
    let tk = a.admit(b, new, Priority::Standard, 1).unwrap().unwrap();
    assert_eq!(tk.pool, Pool::Burst); // the old guarantee entry does not carry over
    a.release(&tk, None).unwrap();
    // the name of a removed tenant can be registered again (a new id when one is free)
    a.remove_tenant(other).unwrap();
    assert_eq!(
        a.add_tenant("other", &limited(Priority::Standard, 1, 0, ALL_BACKENDS))
            .unwrap(),
        other
    );
}

#[test]
fn capacity_limits_say_a_restart_is_needed() {
    let a = heap_core(1, 8, 2);
    big_backend(&a, "b0", 8);
    let err = a
        .add_backend(
            "b1",
            &BackendConfig {
                max_concurrency: 1,
                tokens_per_minute: 1,
                burst_tokens: None,
                inflight_token_limit: None,
            },
        )
        .unwrap_err();
    assert!(err.to_string().contains("restart kvgate"), "{err}");
    for i in 0..2 {
        a.add_tenant(
            &format!("g{i}"),
            &limited(Priority::Critical, 1, 1, ALL_BACKENDS),
        )
        .unwrap();
    }
    let err = a
        .add_tenant("g2", &limited(Priority::Critical, 1, 1, ALL_BACKENDS))
        .unwrap_err();
    assert!(err.to_string().contains("guarantee table is full"), "{err}");
    assert_eq!(a.tenant_id("g2"), None); // nothing registered
    assert_eq!(a.backend_state(0).unwrap().guaranteed_slots, 2);
}

#[test]
fn tenants_with_guarantees_added_and_removed_by_reloads_do_not_fill_the_guarantee_table() {
    // room for 2 entries and 64 tenants: each round removes the two guaranteed tenants and
    // adds two new ones; the new ones take the removed ids (and their entries) once the table
    // is full, not never-used ids that would need entries of their own
    let a = heap_core(1, 64, 2);
    big_backend(&a, "b0", 8);
    let mut ids = Vec::new();
    for round in 0..40 {
        for id in ids.drain(..) {
            a.remove_tenant(id).unwrap();
        }
        for i in 0..2 {
            let id = a
                .add_tenant(
                    &format!("g{round}-{i}"),
                    &limited(Priority::Critical, 1, 1, ALL_BACKENDS),
                )
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
            ids.push(id);
        }
        assert_eq!(
            a.backend_state(0).unwrap().guaranteed_slots,
            2,
            "round {round}"
        );
    }
    // a third guaranteed tenant still does not fit: the table is full and no id is free
    let err = a
        .add_tenant("g-extra", &limited(Priority::Critical, 1, 1, ALL_BACKENDS))
        .unwrap_err();
    assert!(err.to_string().contains("guarantee table is full"), "{err}");
}

#[test]
fn guarantee_entries_needed_counts_what_setting_a_tenant_would_add() {
    // 3 backends, room for 8 entries: what `add_tenant` / `update_tenant` would add is what
    // `guarantee_entries_needed` says, and `guarantee_entries_free` goes down by as much
    let a = heap_core(3, 8, 8);
    for name in ["b0", "b1", "b2"] {
        big_backend(&a, name, 8);
    }
    let all = limited(Priority::Critical, 4, 1, ALL_BACKENDS);
    let two = limited(
        Priority::Standard,
        4,
        0,
        GuaranteedBackends::Only(vec![0, 2]),
    );
    let none = limited(Priority::Standard, 4, 0, ALL_BACKENDS);
    assert_eq!(a.guarantee_entries_free(), 8);
    assert_eq!(a.guarantee_entries_needed(None, &all), [0, 1, 2]);
    assert_eq!(a.guarantee_entries_needed(None, &two), [0, 2]); // a list takes entries, even at 0
    assert_eq!(a.guarantee_entries_needed(None, &none), Vec::<u32>::new());
    let t = a.add_tenant("t", &two).unwrap();
    assert_eq!(
        (a.guarantee_entries_of(t), a.guarantee_entries_free()),
        (vec![0, 2], 6)
    );
    // set to every backend: only b1 is missing
    assert_eq!(a.guarantee_entries_needed(Some(t), &all), [1]);
    a.update_tenant(t, &all).unwrap();
    assert_eq!(
        (a.guarantee_entries_of(t), a.guarantee_entries_free()),
        (vec![0, 1, 2], 5)
    );
    // dropping the guarantee adds nothing, and the entries stay (never freed)
    assert_eq!(
        a.guarantee_entries_needed(Some(t), &none),
        Vec::<u32>::new()
    );
    a.update_tenant(t, &none).unwrap();
    assert_eq!(
        (a.guarantee_entries_of(t), a.guarantee_entries_free()),
        (vec![0, 1, 2], 5)
    );
    // ids past the registered ones: nothing
    assert_eq!(a.guarantee_entries_of(7), Vec::<u32>::new());
    let past = limited(
        Priority::Standard,
        4,
        1,
        GuaranteedBackends::Only(vec![0, 9]),
    );
    assert_eq!(a.guarantee_entries_needed(None, &past), [0]);
}

#[test]
fn a_removal_by_name_leaves_a_tenant_that_took_the_id_since() {
    // two processes apply one reload: the first removed `old` and gave its id to `new`; the
    // second's removal of `old` (by the id it looked up before) must not remove `new`
    let a = heap_core(1, 1, 1);
    big_backend(&a, "b0", 8);
    let cfg = limited(Priority::Standard, 2, 0, ALL_BACKENDS);
    let old = a.add_tenant("old", &cfg).unwrap();
    assert!(a.remove_tenant_named(old, "old").unwrap());
    let new = a.add_tenant("new", &cfg).unwrap();
    assert_eq!(new, old); // the only id, reused
    assert!(!a.remove_tenant_named(old, "old").unwrap());
    assert_eq!(a.tenant_id("new"), Some(new));
    assert!(!a.tenant_removed(new).unwrap());
    assert!(a.remove_tenant_named(new, "new").unwrap());
    assert!(!a.remove_tenant_named(new, "new").unwrap()); // already removed: nothing
}

#[test]
fn an_added_tenant_takes_the_removed_id_whose_entries_suit_it_best() {
    // a full table (2 entries): `on0` holds b0's entry, `on1` b1's; both are removed. A tenant
    // guaranteed on b1 fits only in `on1`'s id (the first removed id would need a new entry),
    // and a tenant without a guarantee takes an id without entries, keeping `on0`'s for a
    // tenant that needs it
    let a = heap_core(2, 4, 2);
    big_backend(&a, "b0", 8);
    big_backend(&a, "b1", 8);
    let only = |bi: u32| limited(Priority::Critical, 2, 1, GuaranteedBackends::Only(vec![bi]));
    let plain = limited(Priority::Standard, 2, 0, ALL_BACKENDS);
    let on0 = a.add_tenant("on0", &only(0)).unwrap();
    let on1 = a.add_tenant("on1", &only(1)).unwrap();
    let bare = a.add_tenant("bare", &plain).unwrap();
    a.add_tenant("keep", &plain).unwrap();
    assert_eq!(a.guarantee_entries_free(), 0);
    for id in [on0, on1, bare] {
        a.remove_tenant(id).unwrap();
    }
    assert_eq!(a.add_tenant("new1", &only(1)).unwrap(), on1);
    assert_eq!(a.add_tenant("plain", &plain).unwrap(), bare);
    assert_eq!(a.add_tenant("new0", &only(0)).unwrap(), on0);
    for bi in 0..2 {
        assert_eq!(a.backend_state(bi).unwrap().guaranteed_slots, 1);
    }
    assert_eq!(a.guarantee_entries_free(), 0);
}

#[test]
fn most_headroom_picks_the_freest_replica_then_the_lowest_kv_usage() {
    let (a, _clock, b0) = setup(); // 4 slots
    let cfg = BackendConfig {
        max_concurrency: 8,
        tokens_per_minute: 60_000,
        burst_tokens: None,
        inflight_token_limit: None,
    };
    let b1 = a.add_backend("b1", &cfg).unwrap();
    let t = tenant(&a, "t", Priority::Standard, 0, None);
    assert_eq!(a.most_headroom::<u8, _>([]).unwrap(), None);
    // both free: the lower KV usage (unknown counts as 0), ties to the first
    assert_eq!(
        a.most_headroom([(0, b0, Some(0.5)), (1, b1, Some(0.2))])
            .unwrap(),
        Some(1)
    );
    assert_eq!(
        a.most_headroom([(0, b0, None), (1, b1, Some(0.0))])
            .unwrap(),
        Some(0)
    );
    // 2 of 4 held on b0 (free 0.5) against 3 of 8 on b1 (free 0.625): b1, whatever its KV
    let held: Vec<_> = [b0, b0, b1, b1, b1]
        .iter()
        .map(|&b| a.admit(b, t, Priority::Standard, 1).unwrap().unwrap())
        .collect();
    assert_eq!(
        a.most_headroom([(0, b0, Some(0.0)), (1, b1, Some(0.9))])
            .unwrap(),
        Some(1)
    );
    // b1 scaled to 4 slots (3 held: free 0.25): b0 now
    a.set_scale(b1, 0.5).unwrap();
    assert_eq!(
        a.most_headroom([(0, b0, Some(0.9)), (1, b1, Some(0.0))])
            .unwrap(),
        Some(0)
    );
    for tk in &held {
        a.release(tk, Some(0)).unwrap();
    }
    assert!(a.most_headroom([(0, b0, None), (1, 99, None)]).is_err());
}
