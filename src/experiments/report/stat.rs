//! The report's statistics: mean and spread over seeds, differences paired by seed, and the
//! power-law fit of loss against compute for the scaling suite.

use serde::Serialize;

/// Mean and sample standard deviation (0 for a single value).
#[derive(Serialize, Clone, Copy, Debug, PartialEq)]
pub struct Stat {
    pub mean: f64,
    pub std: f64,
}

pub fn stat(v: &[f64]) -> Stat {
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let std = if v.len() > 1 {
        (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    Stat { mean, std }
}

/// Differences `a - b` over the seeds both have finished, paired by seed (`None`: not finished).
pub fn paired_differences(a: &[Option<f64>], b: &[Option<f64>]) -> Vec<f64> {
    a.iter().zip(b).filter_map(|(a, b)| Some((*a)? - (*b)?)).collect()
}

/// One point of the scaling suite.
#[derive(Serialize, Clone)]
pub struct ScalePoint {
    pub variant: String,
    pub mode: String,
    pub non_embedding_parameters: usize,
    pub tokens: usize,
    pub flops: f64,
    pub val_loss: f64,
}

/// `loss = a · C^-alpha`, fitted by least squares in log-log space.
#[derive(Serialize, Clone, Copy, Debug)]
pub struct PowerLaw {
    pub a: f64,
    pub alpha: f64,
}

impl PowerLaw {
    pub fn fit(points: &[(f64, f64)]) -> PowerLaw {
        let n = points.len() as f64;
        let (xs, ys): (Vec<f64>, Vec<f64>) = points.iter().map(|(c, l)| (c.ln(), l.ln())).unzip();
        let (mx, my) = (xs.iter().sum::<f64>() / n, ys.iter().sum::<f64>() / n);
        let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
        let sxx: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
        let slope = sxy / sxx;
        PowerLaw { a: (my - slope * mx).exp(), alpha: -slope }
    }

    pub fn loss(&self, c: f64) -> f64 {
        self.a * c.powf(-self.alpha)
    }

    /// The compute at which the fit reaches `loss`.
    pub fn compute_for(&self, loss: f64) -> f64 {
        (self.a / loss).powf(1.0 / self.alpha)
    }
}

#[derive(Serialize)]
pub struct Scaling {
    pub points: Vec<ScalePoint>,
    pub standard: Option<PowerLaw>,
    pub block: Option<PowerLaw>,
    /// At the largest size: the compute the baseline's fit needs to reach Block's loss, divided
    /// by Block's compute (docs/method.md §6: 1.25 in the report).
    pub compute_advantage: Option<f64>,
}

impl Scaling {
    /// Fits a power law to each mode's points and compares the two at the largest size.
    pub fn fit(points: Vec<ScalePoint>) -> Scaling {
        let fit = |mode: &str| {
            let p: Vec<(f64, f64)> =
                points.iter().filter(|p| p.mode == mode).map(|p| (p.flops, p.val_loss)).collect();
            (p.len() >= 2).then(|| PowerLaw::fit(&p))
        };
        let (standard, block) = (fit("standard"), fit("block"));
        let largest =
            points.iter().filter(|p| p.mode == "block").max_by(|a, b| a.flops.total_cmp(&b.flops));
        let compute_advantage = match (standard, largest) {
            (Some(s), Some(b)) => Some(s.compute_for(b.val_loss) / b.flops),
            _ => None,
        };
        Scaling { points, standard, block, compute_advantage }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_are_mean_and_sample_std() {
        let s = stat(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s.mean, 2.5);
        assert!((s.std - (5.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(stat(&[7.0]).std, 0.0);
    }

    #[test]
    fn power_law_fit_recovers_its_parameters() {
        let truth = PowerLaw { a: 7.5, alpha: 0.07 };
        let pts: Vec<(f64, f64)> =
            [1e12, 3e12, 1e13, 4e13].iter().map(|c| (*c, truth.loss(*c))).collect();
        let f = PowerLaw::fit(&pts);
        assert!((f.a - 7.5).abs() < 1e-6 && (f.alpha - 0.07).abs() < 1e-9, "{f:?}");
        // A baseline 1.25x less compute-efficient needs 1.25x the compute for the same loss.
        let slower = PowerLaw { a: truth.a * 1.25f64.powf(truth.alpha), alpha: truth.alpha };
        assert!((slower.compute_for(truth.loss(1e13)) / 1e13 - 1.25).abs() < 1e-9);
    }
}
