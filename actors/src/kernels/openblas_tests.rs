//! The unit tests of `openblas.rs` (a child module of it, where its `unsafe` is allowed: the
//! stand-in kernel writes through raw pointers as OpenBLAS does): extents checked before the
//! call, the start check against a subtly wrong kernel, and the core this machine runs.

use super::*;

#[test]
fn extents_outside_the_slice_are_refused_before_the_call() {
    let plain = |ld| Operand {
        transposed: false,
        ld,
    };
    assert!(plain(3).check("a", 2, 3, 6).is_ok());
    assert!(plain(3).check("a", 2, 3, 5).is_err());
    assert!(plain(2).check("a", 2, 3, 100).is_err(), "ld below the row length");
    let t = Operand {
        transposed: true,
        ld: 2,
    };
    // A 3×2 matrix stored transposed: 2 stored rows of 3 → needs ld ≥ 3.
    assert!(t.check("b", 3, 2, 100).is_err());
    assert!(
        Operand {
            transposed: true,
            ld: 3
        }
        .check("b", 3, 2, 6)
        .is_ok()
    );
    assert!(plain(0).check("a", 0, 0, 0).is_err());
    assert!(plain(1).check("a", 0, 0, 0).is_ok());
}

#[test]
fn the_loaded_library_is_not_called_with_a_matrix_outside_its_slice() {
    let fix = "scripts/test.sh installs Debian's libopenblas0-pthread (as root or with sudo)";
    let Some(blas) = crate::prerequisite::require(library(), fix) else {
        return;
    };
    let plain = |ld| Operand {
        transposed: false,
        ld,
    };
    let mut c = vec![0.0; 3];
    assert!(
        blas.sgemm((2, 2, 2), &[1.0; 4], plain(2), &[1.0; 4], plain(2), &mut c, 2)
            .is_err()
    );
}

/// A stand-in `cblas_sgemm` (row-major, β = 0): the exact sums in plain loops, and with
/// `OFF` one value of every product 0.1 % off — a kernel subtly wrong.
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn stand_in<const OFF: bool>(
    _order: c_int,
    ta: c_int,
    tb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    _beta: f32,
    c: *mut f32,
    ldc: c_int,
) {
    let [m, n, k, lda, ldb, ldc] = [m, n, k, lda, ldb, ldc].map(|v| v as usize);
    let at = |i, p| {
        if ta == CBLAS_TRANS {
            p * lda + i
        } else {
            i * lda + p
        }
    };
    let bt = |p, j| {
        if tb == CBLAS_TRANS {
            j * ldb + p
        } else {
            p * ldb + j
        }
    };
    for i in 0..m {
        for j in 0..n {
            // SAFETY: `sgemm_uninit` checked that every index lies inside its slice.
            let sum: f32 = (0..k)
                .map(|p| unsafe { *a.add(at(i, p)) * *b.add(bt(p, j)) })
                .sum();
            let off = if OFF && i == m / 2 && j == n / 2 {
                1.001
            } else {
                1.0
            };
            // SAFETY: as above, for `c` (borrowed mutably by the caller).
            unsafe { *c.add(i * ldc + j) = alpha * sum * off };
        }
    }
}

#[test]
fn the_start_check_passes_an_exact_kernel_and_refuses_a_subtly_wrong_one() {
    let with = |sgemm: SgemmFn| OpenBlas {
        _library: None,
        sgemm,
        core: "stand-in".to_string(),
        detected: None,
        description: "stand-in".to_string(),
    };
    let exact = with(stand_in::<false>);
    exact.overwrites_c().unwrap();
    super::super::openblas_check::agrees_with_flex(&exact).unwrap();
    // Control: the same check refuses a kernel that is 0.1 % off at one value.
    let wrong = super::super::openblas_check::agrees_with_flex(&with(stand_in::<true>));
    assert!(wrong.is_err_and(|why| why.contains("wrong products")));
}

/// On this machine the library runs kernels as new as the CPU's features allow (unless the
/// user chose its core), whatever OpenBLAS detected, and says so.
#[test]
fn the_loaded_library_runs_kernels_as_new_as_the_cpu_allows() {
    let fix = "scripts/test.sh installs Debian's libopenblas0-pthread (as root or with sudo)";
    let Some(blas) = crate::prerequisite::require(library(), fix) else {
        return;
    };
    eprintln!("{}", blas.description);
    if std::env::var_os(CORETYPE_ENV).is_some() {
        return;
    }
    let allowed = CpuFeatures::of_this_cpu().level();
    let runs = core_type::level_of(&blas.core);
    assert!(
        runs.is_none() || runs >= allowed,
        "{allowed:?}: {}",
        blas.description
    );
    assert!(blas.detected.is_some() && blas.description.contains(&blas.core));
}
