# Mass recall vs budget, one panel per (capture, layer), from kvsift_fidelity --plot-data: per selector the
# mean over (position, query head), with bars from its 10th to its 90th percentile. Usage:
#   gnuplot -e "data='mass.dat'; out='plot.png'" bench/fidelity_plot.gp
panels = system("sed -n 's/^# panel //p' " . data)
n = words(panels)
columns = system("sed -n '2p' " . data . " | wc -w")
selectors = (columns - 1) / 3
set terminal pngcairo size (420 * n), 520 font ",10"
set output out
set datafile missing "NaN"
set termoption noenhanced  # selector names hold underscores
set xlabel "budget (% of the context at the first decode position)"
set ylabel "mass recall (mean, p10-p90)"
set yrange [0:1]
budgets = system("awk 'NR > 2 && NF == 0 { exit } NR > 2 { print $1 }' " . data)
set logscale x
set xrange [0.8 * real(word(budgets, 1)):1.25 * real(word(budgets, words(budgets)))]
set xtics ()
do for [b in budgets] { set xtics add (b real(b)) }
set grid
set key outside top center horizontal samplen 2 maxrows 1 width -2 font ",9"
set multiplot layout 1, n
do for [i = 1:n] {
  set title word(panels, i) noenhanced
  plot for [s = 0:selectors - 1] data index (i - 1) using ($1 * (1 + 0.03 * (s - 1))):(column(2 + 3 * s)):(column(3 + 3 * s)):(column(4 + 3 * s)) \
       with yerrorlines lw 2 pt 7 title columnhead(2 + 3 * s)
}
unset multiplot
