//! Tests of host, device and registered memory.

use super::*;

/// `memory` registered for a landing of its own.
fn registered(memory: HostMemory) -> HostRegistration {
    memory.register(LandingId::fresh()).unwrap()
}

#[test]
fn host_memory_is_registered_for_one_landing_at_a_time() {
    let memory = HostMemory::owned([vec![0u8; 64]]).unwrap();
    let (a, b) = (LandingId::fresh(), LandingId::fresh());
    assert!(!memory.is_registered());
    let first = memory.register(a).unwrap();
    assert!(memory.is_registered());
    // Another landing (another worker) is refused, through any clone of the memory.
    assert!(matches!(
        memory.clone().register(b),
        Err(MemoryError::InUse)
    ));
    // The same landing may hold it twice (a resume onto the memory it is on).
    let again = memory.register(a).unwrap();
    drop(first);
    assert!(matches!(memory.register(b), Err(MemoryError::InUse)));
    drop(again);
    // The last hold gone, the memory is free for another landing, and the host's again.
    assert!(!memory.is_registered());
    let other = memory.register(b).unwrap();
    drop(other);
    assert_eq!(memory.take_back().unwrap().len(), 1);
}

#[test]
fn host_memory_is_zeroed_bounds_checked_and_round_trips() {
    let m = RegisteredMemory::new(MemoryKind::Host, 8192).unwrap();
    assert_eq!(m.snapshot(0, 8192).unwrap(), vec![0u8; 8192]);
    m.write(4090, &[1, 2, 3, 4, 5, 6]).unwrap();
    assert_eq!(m.snapshot(4090, 6).unwrap(), vec![1, 2, 3, 4, 5, 6]);
    assert!(matches!(
        m.write(8190, &[0; 4]),
        Err(MemoryError::OutOfBounds { .. })
    ));
    assert!(matches!(
        m.snapshot(u64::MAX, 2),
        Err(MemoryError::OutOfBounds { .. })
    ));
}

#[test]
fn host_owned_regions_back_their_layout_spans_without_copying() {
    let mut a = vec![0u8; 64];
    let mut b = vec![0u8; 100]; // longer than its span: the tail is never touched
                                // SAFETY: both Vecs outlive `m` and are read only after it is dropped.
    let regions = unsafe {
        vec![
            HostRegion::new(a.as_mut_ptr(), a.len()).unwrap(),
            HostRegion::new(b.as_mut_ptr(), b.len()).unwrap(),
        ]
    };
    let m = RegisteredMemory::host_owned(registered(HostMemory::new(regions)), &[(0, 64), (64, 64)]).unwrap();
    assert!(m.is_host_owned());
    assert_eq!(m.len(), 128);
    m.write(60, &[1, 2, 3, 4]).unwrap();
    m.write(64, &[5, 6]).unwrap();
    // A read may span regions; a write may not (a write never crosses a layout region).
    assert_eq!(m.snapshot(60, 6).unwrap(), vec![1, 2, 3, 4, 5, 6]);
    assert!(matches!(
        m.write(62, &[0; 4]),
        Err(MemoryError::OutOfBounds { .. })
    ));
    assert!(m.write(126, &[0; 4]).is_err());
    drop(m);
    assert_eq!(&a[60..], &[1, 2, 3, 4]);
    assert_eq!(&b[..2], &[5, 6]);
    assert!(b[64..].iter().all(|&x| x == 0));
}

#[test]
fn host_regions_whose_used_bytes_overlap_are_refused() {
    let mut a = vec![0u8; 256];
    let p = a.as_mut_ptr();
    let host = |offsets: [usize; 2]| {
        // SAFETY: `a` outlives every HostMemory here; nothing is written.
        let regions = offsets
            .iter()
            .map(|&o| unsafe { HostRegion::new(p.add(o), 128).unwrap() })
            .collect();
        RegisteredMemory::host_owned(registered(HostMemory::new(regions)), &[(0, 64), (64, 64)])
    };
    // The same buffer twice, and the second region starting inside the first's 64 bytes.
    for offsets in [[0, 0], [0, 32], [32, 0]] {
        let Err(e) = host(offsets) else {
            panic!("{offsets:?}: overlap accepted")
        };
        assert!(e.to_string().contains("regions 0 and 1 overlap"), "{e}");
    }
    // Adjacent is fine: the first's span ends where the second begins (its unused tail may
    // overlap the next region: only the layout's bytes are written).
    assert!(host([0, 64]).is_ok());
    assert!(host([128, 0]).is_ok());
}

#[test]
fn a_region_one_block_short_says_too_short_not_overlap() {
    // One allocation carved per layer, the first one block (32 bytes) short: its span
    // (64 bytes) runs into the second region.
    let mut a = vec![0u8; 256];
    let p = a.as_mut_ptr();
    // SAFETY: `a` outlives the regions; nothing is written (the start is refused).
    let regions = unsafe {
        vec![
            HostRegion::new(p, 32).unwrap(),
            HostRegion::new(p.add(32), 64).unwrap(),
        ]
    };
    let Err(e) = RegisteredMemory::host_owned(registered(HostMemory::new(regions)), &[(0, 64), (64, 64)])
    else {
        panic!("a short region accepted")
    };
    assert!(e.to_string().contains("region 0 has 32 bytes"), "{e}");
}

#[test]
fn host_device_regions_are_checked_and_need_cuda() {
    // SAFETY: never dereferenced: every start below is refused before any copy.
    let r = |ordinal, ptr, len| unsafe { DeviceRegion::new(ordinal, ptr, len) }.unwrap();
    let spans = [(0, 64), (64, 64)];
    let err =
        |regions| RegisteredMemory::device_owned(DeviceMemory::new(regions), &spans).unwrap_err();
    let (p0, p1) = (0x7000_0000, 0x7000_1000);
    assert!(matches!(
        err(vec![r(0, p0, 64)]),
        MemoryError::DeviceRegions(_)
    ));
    assert!(matches!(
        err(vec![r(0, p0, 64), r(0, p1, 63)]),
        MemoryError::DeviceRegions(_)
    ));
    assert!(matches!(
        err(vec![r(0, p0, 64), r(1, p1, 64)]),
        MemoryError::DeviceRegions(_)
    ));
    let e = err(vec![r(0, p0, 64), r(0, p0 + 32, 64)]);
    assert!(e.to_string().contains("overlap"), "{e}");
    // Short, and ending where the next begins: too short is the mistake, not an overlap.
    let e = err(vec![r(0, p0, 32), r(0, p0 + 32, 64)]);
    assert!(e.to_string().contains("region 0 has 32 bytes"), "{e}");
    // Fits: the feature and a driver decide.
    let e = err(vec![r(0, p0, 64), r(0, p1, 64)]);
    #[cfg(not(feature = "cuda"))]
    assert!(matches!(e, MemoryError::CudaNotBuilt), "{e}");
    #[cfg(feature = "cuda")]
    // With a driver, these made-up pointers are unknown to it.
    assert!(
        matches!(
            e,
            MemoryError::NoCudaDriver
                | MemoryError::Cuda(_)
                | MemoryError::UnknownPointer { region: 0, .. }
        ),
        "{e}"
    );
    // SAFETY: refused before use.
    assert!(unsafe { DeviceRegion::new(0, 0, 8) }.is_err());
}

#[test]
fn staged_memory_is_reached_only_through_copies() {
    let (dev, view) = DeviceMemory::fake(256);
    let m = RegisteredMemory::device_owned(dev, &[(0, 128), (128, 128)]).unwrap();
    assert!(m.is_staged());
    m.write(120, &[1; 16]).unwrap();
    assert_eq!(view.snapshot(120, 16), vec![1; 16]);
    assert_eq!(m.snapshot(118, 4).unwrap(), vec![0, 0, 1, 1]);
    // Refused: the memory is not host-addressable.
    assert!(m.landing_ptr(0, 8).is_err());
    assert!(m.upload(250, &[0; 8]).is_err());
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_is_a_typed_error() {
    assert!(matches!(
        RegisteredMemory::new(MemoryKind::Cuda { ordinal: 0 }, 16),
        Err(MemoryError::CudaNotBuilt)
    ));
}

/// Built with `cuda`: a typed error without a driver, a device round trip with one.
#[cfg(feature = "cuda")]
#[test]
fn cuda_memory_round_trips_or_reports_a_missing_driver() {
    match RegisteredMemory::new(MemoryKind::Cuda { ordinal: 0 }, 1 << 20) {
        Err(MemoryError::NoCudaDriver) => {
            eprintln!("no CUDA driver here: GPU path not exercised")
        }
        Err(e) => panic!("unexpected error: {e}"),
        Ok(m) => {
            assert!(m.is_gpu());
            m.write(4096, &[9; 64]).unwrap();
            // `read` comes from device memory, so this proves the commit reached the GPU.
            assert_eq!(m.snapshot(4096, 64).unwrap(), vec![9; 64]);
            assert_eq!(m.snapshot(0, 8).unwrap(), vec![0; 8]);
        }
    }
}
