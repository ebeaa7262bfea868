# End-to-end quality vs budget, from tools/capture/e2e.py --plot-data: per text, perplexity of the decoded part
# (the dashed line is dense decoding's) and top-1 agreement with dense decoding, one line per selector. Usage:
#   gnuplot -e "data='e2e.dat'; out='plot.png'" bench/e2e_plot.gp
panels = system("sed -n 's/^# panel \\([^ ]*\\).*/\\1/p' " . data)
dense = system("sed -n 's/^# panel .* dense_ppl //p' " . data)
n = words(panels)
columns = system("sed -n '2p' " . data . " | wc -w")
selectors = (columns - 1) / 2
set terminal pngcairo size 900, (380 * n) font ",10"
set output out
set datafile missing "NaN"
set logscale x
set xlabel "budget: middle tokens per kv head (+ 4 sinks, 16 recent)"
set grid
set key top right font ",9"
set multiplot layout n, 2
do for [i = 1:n] {
  set title word(panels, i) . ": perplexity of the decoded part" noenhanced
  set ylabel "perplexity"
  set logscale y
  plot for [s = 0:selectors - 1] data index (i - 1) using 1:(column(2 + 2 * s)) with linespoints lw 2 pt 7 title columnhead(2 + 2 * s) noenhanced, \
       real(word(dense, i)) with lines dt 2 lc rgb "black" title "dense"
  unset logscale y
  set title word(panels, i) . ": top-1 agreement with dense" noenhanced
  set ylabel "top-1 agreement"
  set yrange [0:1]
  set key bottom right
  plot for [s = 0:selectors - 1] data index (i - 1) using 1:(column(3 + 2 * s)) with linespoints lw 2 pt 7 title columnhead(3 + 2 * s) noenhanced
  set autoscale y
  set key top right
}
unset multiplot
